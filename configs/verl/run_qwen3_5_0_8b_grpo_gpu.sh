#!/usr/bin/env bash
# GRPO, n=8, Qwen/Qwen3.5-0.8B on GPU with ps-bridge prefix sharing (verl 0.9.1, Megatron engine).
set -euo pipefail
export MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3.5-0.8B}
export PS_PROVIDER=qwen3.5
export DEVICE=cuda
exec "$(dirname "$0")/grpo_prefix_sharing.sh" "$@"
