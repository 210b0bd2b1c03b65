#!/usr/bin/env bash
# GRPO, n=8, Qwen/Qwen2.5-0.5B-Instruct on NPU with ps-bridge prefix sharing (verl 0.9.1, Megatron engine).
# NPU (Ascend, verl's MindSpeed engine): UNVERIFIED - written from verl's NPU engine registration, never run.
set -euo pipefail
export MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
export PS_PROVIDER=qwen2.5
export DEVICE=npu
exec "$(dirname "$0")/grpo_prefix_sharing.sh" "$@"
