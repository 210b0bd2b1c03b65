#!/usr/bin/env bash
# One GPU run for the MoE and verl-check GPU rows when time is short (a subset of
# tools/gpu_moe.sh and tools/gpu_verl_check.sh; each step has its own time limit):
#   1. tests/test_grouped_experts.py (grouped_mm on CUDA vs the per-expert loop)
#   2. the Qwen3.5-35B-A3B MoE layer alone, grouped vs sequential experts   -> moe_layer.json
#   3. the 35B-A3B actor step (4 layers) at (2048, 512, 8) --groups 4       -> bench_g4.json
#   4. verl-check, Qwen2.5-7B shape (4 layers), 3 steps, the data and budgets of BENCHMARKS.md
#                                                                           -> verl_check_qwen2.5-7b.json/.png
# Logs of 2-4 in run.log. Usage (repository root): OUT=... tools/gpu_moe_verl.sh
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
tools/gpu_checks.sh tests/test_grouped_experts.py
source tools/gpu_env.sh
log="$OUT/run.log"
echo "=== moe layer ($(date +%T))" | tee -a "$log"
timeout 120 python3 -m ps_bridge.tools.bench.moe_layer --json "$OUT/moe_layer.json" >>"$log" 2>&1; echo "=== exit $?" >>"$log"
echo "=== moe actor rows ($(date +%T))" | tee -a "$log"
timeout 150 python3 -m ps_bridge.tools.cli bench --no-progress --models qwen3.5-35b-a3b --warmup 1 --repeats 3 \
  --grid 2048,512,8 --groups 4 --json "$OUT/bench_g4.json" >>"$log" 2>&1; echo "=== exit $?" >>"$log"
save_autotune
python3 -c "import verl, tensordict; print('verl', verl.__version__, 'tensordict', tensordict.__version__)" >>"$OUT/versions.txt" 2>&1
echo "=== verl-check qwen2.5-7b ($(date +%T))" | tee -a "$log"
timeout 230 python3 -m ps_bridge.tools.cli verl-check --model qwen2.5-7b --no-progress --workdir /tmp/verl-check --layers 4 \
  --prompts 32 --n 8 --prompt-len 2048 --response-len 512 --steps 3 --dtype bfloat16 \
  --json "$OUT/verl_check_qwen2.5-7b.json" --plot "$OUT/verl_check_qwen2.5-7b.png" \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
  >>"$log" 2>&1; echo "=== exit $? ($(date +%T))" >>"$log"
save_autotune
tail -60 "$log"
