#!/usr/bin/env bash
# The small shapes (is sharing ever slower than sharing off?) on one GPU, in one run:
#   base   the rows where sharing pays today: bench Qwen2.5-7B shape (2048, 512, 8) 4 layers, and
#          Qwen3.5-0.8B shape (2048, 512, 8) --groups 4 (its bench default of 8 layers);
#   small  bench rows of the small shapes (24 layers, --groups 4: a verl update micro-batch of the
#          settings of BENCHMARKS.md) that calibrate the sharing rule (ps_bridge/launch_rule.py);
#   prof   tools/profile_bench_row.py on Qwen3.5-0.8B and Qwen2.5-0.5B (128, 32, 8) x 4 groups, 24 layers
#          (host vs GPU time per layer, launches, syncs);
#   verl   `ps-bridge verl-check` at the small-shape settings (8 prompts x n = 8, 3 steps, mini-batch of 4
#          prompts) for the runs given in VERL_RUNS ("model:P:R:mode ...", mode = PS_BRIDGE_SHARING of
#          the prefix-shared engine: auto, measured, on or off; the stock engine is unaffected);
#   grid   tools/verl_check_grid.py: the same settings for every "model:P:R" of VERL_GRID (comma-separated)
#          in one process, the first engine being ours with sharing disabled (sharing on vs off alone).
# Usage (repository root): STEPS="base small prof verl" VERL_RUNS="qwen3.5-0.8b:128:32:auto" tools/gpu_small_shapes.sh
# Everything runs within BUDGET_S seconds (default 560): each step gets what is left. SMALL_MODELS,
# SMALL_GRID, SMALL_LIMIT (seconds, default 180) and VERL_LIMIT (seconds per verl-check run, default 200) narrow the steps.
# Results in $OUT: small-$TAG.log (every step's output), results.tar.gz (bench / verl-check JSON,
# profile tables, under $TAG/), triton-autotune.tar.gz (kernel caches for the next run: copy to .whl/).
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
TAG=${TAG:-run}  # names this tree's log and results (several trees may run in one run)
RES=/tmp/ps-bridge-res/$TAG
mkdir -p "$RES"
source tools/gpu_env.sh
gpu_setup || exit 1
save_all() { save_autotune; tar -C /tmp/ps-bridge-res -czf "$OUT/.res.tmp" . 2>/dev/null && mv "$OUT/.res.tmp" "$OUT/results.tar.gz"; }
( while sleep 20; do save_all; done ) &
saver=$!
trap 'kill $saver 2>/dev/null; save_all' EXIT
LOG="$OUT/small-$TAG.log"
BUDGET_S=${BUDGET_S:-560}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
step() {  # NAME LIMIT CMD...: run CMD within min(LIMIT, what is left of the budget)
  local name=$1 limit=$2 left; shift 2
  left=$((BUDGET_S - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "=== $name: skipped (budget spent)" | tee -a "$LOG"; return; fi
  echo "=== [$SECONDS s] $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
  echo "=== [$SECONDS s] $name exit $?" | tee -a "$LOG"
}
BENCH=(python3 -m ps_bridge.tools.cli bench --no-progress)
for s in ${STEPS:-base small prof verl}; do
  case $s in
    base)
      step base-qwen2.5-7b 120 "${BENCH[@]}" --models qwen2.5-7b --layers 4 --grid 2048,512,8 --json "$RES/bench-base-qwen2.5-7b.json"
      step base-qwen3.5-0.8b 180 "${BENCH[@]}" --models qwen3.5-0.8b --grid 2048,512,8 --groups 4 --json "$RES/bench-base-qwen3.5-0.8b.json" ;;
    small)
      step small-bench "${SMALL_LIMIT:-180}" "${BENCH[@]}" --models "${SMALL_MODELS:-qwen3.5-0.8b,qwen2.5-0.5b}" --layers 24 --groups 4 \
        --grid "${SMALL_GRID:-128,32,8;512,32,8;128,256,8;512,256,8}" --json "$RES/bench-small.json" ;;
    prof)
      mkdir -p "$RES/prof"
      step profile 200 python3 tools/profile_bench_row.py --models "${PROF_MODELS:-qwen3.5-0.8b,qwen2.5-0.5b}" --layers 24 \
        --row 128,32,8 --groups 4 --out "$RES/prof" ;;
    grid)  # every (model, P, R) of VERL_GRID in one process, against our engine with sharing off
      step verl-grid "${GRID_LIMIT:-470}" env PS_BRIDGE_SHARING="${GRID_MODE:-auto}" python3 tools/verl_check_grid.py \
        --runs "${VERL_GRID:-qwen3.5-0.8b:128:32,qwen2.5-0.5b:128:32}" --workdir /tmp/verl-check --json "$RES/verl-grid.json" ;;
    verl)
      for run in ${VERL_RUNS:-qwen3.5-0.8b:128:32:auto}; do
        IFS=: read -r model P R mode <<<"$run"
        step "verl-check $model P=$P R=$R sharing=$mode" "${VERL_LIMIT:-200}" env PS_BRIDGE_SHARING="$mode" python3 -m ps_bridge.tools.cli verl-check \
          --model "$model" --layers 24 --no-progress --workdir /tmp/verl-check --prompts 8 --n 8 --prompt-len "$P" \
          --response-len "$R" --steps 3 --dtype bfloat16 --json "$RES/verl-check-$model-P$P-R$R-$mode.json" \
          actor_rollout_ref.actor.ppo_mini_batch_size=4
      done ;;
  esac
done
grep -v -i "warn" "$LOG" | grep -v "^\[PS\]" | grep -E "===|== |x \(|speed-up|^ *[0-9]+ |qwen|S =|ideal" | tail -${TAIL:-80}
