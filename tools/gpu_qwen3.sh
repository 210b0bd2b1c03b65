#!/usr/bin/env bash
# The Qwen3 GPU work on one H200 in under 9 minutes: the bench rows first
# (the figures), then the bf16-vs-fp32 tests, then a verl-check of the Qwen3-8B shape with the time left.
# Unpacks .whl/gpusite.tar.xz (tools/build_gpu_site.sh) and sets the checkout up with gpu_env.sh's gpu_setup.
#
# Usage (repository root): tools/gpu_qwen3.sh
# $OUT gets:
#   versions.txt                   the machine's stack
#   bench_qwen3_8b.json            actor step shared vs unshared, Qwen3-8B shape (4 of 36 layers), (2048, 512, 8), (4096, 256, 16)
#   bench_qwen3_30b_a3b.json       the same, Qwen3-30B-A3B shape (4 of 48 layers), (2048, 512, 8) --groups 4
#   bench.log                      both bench runs' output
#   gpu_tests.log                  tests/test_bf16_vs_fp32_gpu.py's Qwen3 cases (-m gpu)
#   verl_check_qwen3-8b.json / verl_check.log   verl's trainer step, stock engine vs ours, Qwen3-8B shape (4 layers)
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
source tools/gpu_env.sh
gpu_setup || exit 1
cat "$OUT/versions.txt"
echo "=== [$SECONDS s] set up" | tee "$OUT/bench.log"
bench=(python3 -m ps_bridge.tools.cli bench --no-progress --layers 4 --warmup 1 --repeats 3)
timeout 200 "${bench[@]}" --models qwen3-8b --grid "2048,512,8;4096,256,16" --json "$OUT/bench_qwen3_8b.json" >>"$OUT/bench.log" 2>&1
echo "=== [$SECONDS s] qwen3-8b exit $?" >>"$OUT/bench.log"
timeout 150 "${bench[@]}" --models qwen3-30b-a3b --groups 4 --grid 2048,512,8 --json "$OUT/bench_qwen3_30b_a3b.json" >>"$OUT/bench.log" 2>&1
echo "=== [$SECONDS s] qwen3-30b-a3b exit $?" >>"$OUT/bench.log"
grep -v "Warning\|warn" "$OUT/bench.log" | grep "qwen3\|===" | tail -12
mkdir -p /tmp/ps-bridge-pytest
TORCHDYNAMO_DISABLE=1 timeout 130 python3 -m pytest -q -s -ra -m gpu -p no:cacheprovider --basetemp=/tmp/ps-bridge-pytest/q3 \
  tests/test_bf16_vs_fp32_gpu.py -k "qwen3_bf16 or qwen3_moe_bf16" >"$OUT/gpu_tests.log" 2>&1
echo "=== [$SECONDS s] gpu tests exit $?" >>"$OUT/gpu_tests.log"
grep "bf16 vs fp32\|passed\|failed\|===" "$OUT/gpu_tests.log"
left=$((BUDGET - SECONDS))
if [ "$left" -gt 120 ]; then
  timeout "$left" python3 -m ps_bridge.tools.cli verl-check --model qwen3-8b --no-progress --workdir /tmp/verl-check --layers 4 \
    --prompts 32 --n 8 --prompt-len 2048 --response-len 512 --steps 3 --dtype bfloat16 \
    --json "$OUT/verl_check_qwen3-8b.json" \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
    >"$OUT/verl_check.log" 2>&1
  echo "=== [$SECONDS s] verl-check exit $? (limit $left s)" >>"$OUT/verl_check.log"
  grep -v "Warning\|warn" "$OUT/verl_check.log" | tail -20
else
  echo "verl-check not run: $left s left of $BUDGET" | tee "$OUT/verl_check.log"
fi
echo "=== [$SECONDS s] done"
