#!/usr/bin/env bash
# GRPO, n=8, Qwen/Qwen3-30B-A3B (128 experts, top-8) on 8 GPUs with ps-bridge prefix sharing (verl 0.9.1,
# Megatron engine): expert parallelism 8, TP=1 (override TP / EP / PP / NGPUS_PER_NODE from the environment).
set -euo pipefail
export MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-30B-A3B}
export PS_PROVIDER=qwen3-moe
export DEVICE=cuda
export EP=${EP:-8}
exec "$(dirname "$0")/grpo_prefix_sharing.sh" "$@"
