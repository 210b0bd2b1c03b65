#!/usr/bin/env bash
# One verl-check shape (MODEL=qwen2.5-7b by default; LIMIT seconds, default 400), 4 layers, 3 steps, the
# data and budgets of BENCHMARKS.md: a run of its own on one GPU.
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
[ -d /tmp/gpusite ] || tar -C /tmp -xJf .whl/gpusite.tar.xz || exit 1
source tools/gpu_env.sh
prepare_checkout || exit 1
log="$OUT/run.log"
timeout ${LIMIT:-400} python3 -m ps_bridge.tools.cli verl-check --model "${MODEL:-qwen2.5-7b}" --no-progress --workdir /tmp/verl-check --layers 4 \
  --prompts 32 --n 8 --prompt-len 2048 --response-len 512 --steps 3 --dtype bfloat16 \
  --json "$OUT/verl_check_${MODEL:-qwen2.5-7b}.json" --plot "$OUT/verl_check_${MODEL:-qwen2.5-7b}.png" \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
  >>"$log" 2>&1; echo "=== exit $? ($(date +%T))" >>"$log"
grep -v "Warning\|warn" "$log" | tail -25
