#!/usr/bin/env bash
# One GPU: prefix trees (the default) against one level (--no-tree) on the one-level bench row of the
# Qwen2.5-7B shape (4 layers, (2048, 512, 8)) and on verl's trainer step of the same shape with
# BENCHMARKS.md's verl-check settings (tools/verl_check_tree_pair.py: both packings of our engine
# resident, steps in turns). Whatever time is left after the bench rows goes to the trainer step
# (LIMIT: the whole run's seconds, default 320). Results in $OUT: bench-tree.json, bench-no-tree.json,
# verl-check-tree-pair.json, run.log, versions.txt, triton-autotune.tar.gz (carry it as
# .whl/triton-autotune.tar.gz next time).
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
source tools/gpu_env.sh
gpu_setup || exit 1
trap save_autotune EXIT
log="$OUT/run.log"
LIMIT=${LIMIT:-320}
for mode in tree no-tree; do
  flag=(); [ "$mode" = no-tree ] && flag=(--no-tree)
  echo "=== [$SECONDS s] bench, $mode" | tee -a "$log"
  timeout 100 python3 -m ps_bridge.tools.cli bench --no-progress --models qwen2.5-7b --grid 2048,512,8 "${flag[@]}" \
    --json "$OUT/bench-$mode.json" >>"$log" 2>&1
  echo "=== bench $mode exit $?" | tee -a "$log"
done
left=$((LIMIT - SECONDS))
echo "=== [$SECONDS s] verl-check, trees against one level (limit $left s)" | tee -a "$log"
timeout -k 5 "$left" python3 tools/verl_check_tree_pair.py --json "$OUT/verl-check-tree-pair.json" --model qwen2.5-7b \
  --no-progress --workdir /tmp/verl-check --layers 4 --prompts 32 --n 8 --prompt-len 2048 --response-len 512 \
  --steps 3 --dtype bfloat16 actor_rollout_ref.actor.ppo_mini_batch_size=8 \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 >>"$log" 2>&1
echo "=== verl-check exit $? [$SECONDS s]" | tee -a "$log"
grep -E "^\| qwen|^step [0-9]|one level / trees|exit|Error" "$log" | tail -20
