#!/usr/bin/env bash
# GRPO, n=8, Qwen/Qwen3-8B on 8 GPUs with ps-bridge prefix sharing (verl 0.9.1, Megatron engine):
# TP=2 with sequence parallelism, 4 data-parallel ranks (override TP / PP / NGPUS_PER_NODE from the environment).
set -euo pipefail
export MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-8B}
export PS_PROVIDER=qwen3
export DEVICE=cuda
export TP=${TP:-2}
exec "$(dirname "$0")/grpo_prefix_sharing.sh" "$@"
