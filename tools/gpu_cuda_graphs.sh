#!/usr/bin/env bash
# CUDA graphs on bucketed layouts on one GPU, in one run:
#   tests   tests/test_cuda_graphs_gpu.py (replays equal eager; bucketed layouts of other lengths);
#   verl    tools/verl_check_grid.py at the small shapes (24 layers, 8 prompts x n = 8, mini-batch of 4
#           prompts, GRID_STEPS steps, engines interleaved) with PS_BRIDGE_CUDA_GRAPHS=1 for the
#           prefix-shared engine, against our engine with sharing off and graphs BASELINE_GRAPHS
#           (space-separated: "off on" runs the grid twice), the shared packs bucketed as BUCKETS says
#           (PS_BRIDGE_CUDA_GRAPH_BUCKETS: segment, the default, or level; "segment level" runs both);
#   probe   tools/probe_fla_varlen_replay.py (fla's varlen kernels replayed on batches of other lengths);
#   profile tools/profile_verl_phase.py at PROFILE_SHAPE (model:P:R, default qwen3.5-0.8b:128:256; 24 layers,
#           8 prompts x 8, mini-batch of 4 prompts) for PROFILE_PHASES, with PS_BRIDGE_SHARING=PROFILE_SHARING
#           (default on: the shared passes the rule would run unshared) and graphs off (PROFILE_GRAPHS=1: on, in
#           BUCKETS, two warm-up steps; PROFILE_PYTHON=1: cProfile too; PROFILE_KINDS: shared,stock); its files in $OUT/profile.tgz.
# GRID_ORDER: interleave (default: both engines resident, steps in turns) or shared-first (one engine at a
# time, the prefix-shared one first: where both engines and the graphs' memory do not fit on the GPU at once).
# GRID_OVERRIDES: verl settings for the grid (space-separated, default the mini-batch of 4 prompts); on an
# 80 GB card (128, 256) needs smaller log-prob micro-batches, e.g. "actor_rollout_ref.actor.ppo_mini_batch_size=4
# actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384":
# the log-prob pass holds its read positions' bf16 logits, 0.5 MB each with Qwen3.5's vocabulary.
# SIDES="before after": the verl step runs first with the revision archived in .wt/base installed, then with
# this checkout (archive it as tools/gpu_before_after.sh says; carry .wt); default "after" only.
# Usage (repository root): STEPS="tests verl" GRID="qwen3.5-0.8b:128:32" tools/gpu_cuda_graphs.sh
# (TESTS_K: a pytest -k expression narrowing the tests)
# Everything runs within BUDGET_S seconds (default 580). Results in $OUT: cuda-graphs.log, gpu_tests.log,
# verl-grid-[before-]<segment|level>-graphs-vs-<off|on>.json, probe.json, triton-autotune.tar.gz (kernel caches for the next run: copy to .whl/).
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
source tools/gpu_env.sh
gpu_setup || exit 1
LOG="$OUT/cuda-graphs.log"
BUDGET_S=${BUDGET_S:-580}
trap save_autotune EXIT
left() { echo $((BUDGET_S - SECONDS)); }
for s in ${STEPS:-tests verl}; do
  case $s in
    tests)
      echo "=== [$SECONDS s] GPU tests" | tee -a "$LOG"
      timeout -k 5 "${TESTS_LIMIT:-240}" python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_cuda_graphs_gpu.py -k "${TESTS_K:-}" \
        >"$OUT/gpu_tests.log" 2>&1
      echo "=== [$SECONDS s] GPU tests exit $?" | tee -a "$LOG"
      grep -E "passed|failed|error|replay|gradient|bucketed" "$OUT/gpu_tests.log" | tail -40 >>"$LOG"
      save_autotune ;;
    probe)
      echo "=== [$SECONDS s] fla varlen replay probe" | tee -a "$LOG"
      timeout -k 5 120 python3 tools/probe_fla_varlen_replay.py --json "$OUT/probe.json" >>"$LOG" 2>&1
      echo "=== [$SECONDS s] probe exit $?" | tee -a "$LOG" ;;
    profile)
      IFS=: read -r pmodel pp pr <<<"${PROFILE_SHAPE:-qwen3.5-0.8b:128:256}"
      echo "=== [$SECONDS s] profile $pmodel ($pp, $pr)" | tee -a "$LOG"
      mkdir -p /tmp/profile
      profile_args=(--baseline-graphs off); [ "${PROFILE_GRAPHS:-0}" = 1 ] && profile_args+=(--warmup-steps 2)
      [ "${PROFILE_PYTHON:-0}" = 1 ] && profile_args+=(--python-profile)
      PS_BRIDGE_CUDA_GRAPHS=${PROFILE_GRAPHS:-0} PS_BRIDGE_CUDA_GRAPH_BUCKETS=${BUCKETS:-segment} \
      PS_BRIDGE_SHARING=${PROFILE_SHARING:-on} timeout -k 5 "${PROFILE_LIMIT:-150}" python3 tools/profile_verl_phase.py \
        --model "$pmodel" --layers 24 --prompts 8 --n 8 --prompt-len "$pp" --system-prompt-len 0 --response-len "$pr" \
        --phase "${PROFILE_PHASES:-update,old_log_prob}" --kinds "${PROFILE_KINDS:-shared,stock}" --out /tmp/profile "${profile_args[@]}" \
        actor_rollout_ref.actor.ppo_mini_batch_size=4 >/tmp/profile/profile.log 2>&1
      echo "=== [$SECONDS s] profile exit $?" | tee -a "$LOG"
      tar -C /tmp -czf "$OUT/profile.tgz" profile ;;
    verl)
      for side in ${SIDES:-after}; do
        dir=.; tag=; [ "$side" = before ] && { dir=.wt/base; tag=before-; }
        install_editable "$dir" || exit 1
        for buckets in ${BUCKETS:-segment}; do
          for baseline in ${BASELINE_GRAPHS:-off}; do
            limit=$(left)
            [ "$limit" -lt 30 ] && { echo "=== verl grid ($side, $buckets buckets, baseline graphs $baseline): skipped (budget spent)" | tee -a "$LOG"; continue; }
            echo "=== [$SECONDS s] verl grid ($side), $buckets buckets, baseline graphs $baseline (limit ${limit}s)" | tee -a "$LOG"
            (cd "$dir" && PS_BRIDGE_CUDA_GRAPHS=1 PS_BRIDGE_CUDA_GRAPH_BUCKETS=$buckets timeout -k 5 "$limit" python3 tools/verl_check_grid.py \
              --runs "${GRID:-qwen3.5-0.8b:128:32,qwen2.5-0.5b:128:32}" --steps "${GRID_STEPS:-9}" --"${GRID_ORDER:-interleave}" \
              --baseline-graphs "$baseline" --workdir /tmp/verl-check \
              --json "$OUT/verl-grid-$tag$buckets-graphs-vs-$baseline.json" ${GRID_OVERRIDES:-actor_rollout_ref.actor.ppo_mini_batch_size=4}) >>"$LOG" 2>&1
            echo "=== [$SECONDS s] verl grid exit $?" | tee -a "$LOG"
          done
        done
      done
      install_editable ;;
  esac
done
grep -v -i "warn" "$LOG" | grep -v "^\[PS\]\|INFO" | tail -${TAIL:-70}
