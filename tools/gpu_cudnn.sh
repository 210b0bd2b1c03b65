#!/usr/bin/env bash
# cuDNN's attention for long elements (ps_bridge/kernels/attention/cudnn.py) on one GPU, in one run:
#   tests  its GPU tests (TESTS: pytest arguments);
#   bench  each bench of BENCHES (bench arguments, `|`-separated) with torch's cuDNN attention on, then
#          off (`torch.backends.cuda.enable_cudnn_sdp(False)`: flash only), in one process order per bench.
# Usage (repository root): BENCHES="--models qwen3-8b --layers 4 --grid 4096,256,16" tools/gpu_cudnn.sh
# $OUT gets results.tgz (gpu_tests.log, bench_<k>_<on|off>.json and .log), versions.txt, triton-autotune.tar.gz.
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
source tools/gpu_env.sh
gpu_setup || exit 1
R=$(mktemp -d)
BUDGET_S=${BUDGET_S:-560}
if [ -n "${TESTS:-}" ]; then
  read -r -a tests <<<"$TESTS"
  timeout -k 5 "${TESTS_LIMIT:-240}" python3 -m pytest -q -s -m gpu -p no:cacheprovider "${tests[@]}" >"$R/gpu_tests.log" 2>&1
  echo "=== [$SECONDS s] GPU tests exit $?: $(tail -1 "$R/gpu_tests.log")"
  grep -E "rel err|FAILED|Error" "$R/gpu_tests.log" | head -20
  save_autotune
fi
IFS='|' read -r -a benches <<<"${BENCHES:-}"
for k in "${!benches[@]}"; do
  read -r -a bench_args <<<"${benches[$k]}"
  for side in ${SIDES:-on off}; do
    left=$((BUDGET_S - SECONDS)); [ "$left" -lt 40 ] && { echo "=== bench $k $side: skipped (budget spent)"; continue; }
    timeout -k 5 "$left" python3 -c "import sys, torch; torch.backends.cuda.enable_cudnn_sdp(sys.argv[1] == 'on'); \
from ps_bridge.tools.cli import main; sys.exit(main(sys.argv[2:]))" "$side" bench --no-progress "${bench_args[@]}" \
      --json "$R/bench_${k}_$side.json" >"$R/bench_${k}_$side.log" 2>&1
    echo "=== [$SECONDS s] bench $k (${benches[$k]}), cuDNN $side: exit $?"
    grep "^|" "$R/bench_${k}_$side.log" | tail -n +3 | sort -u
  done
  save_autotune
done
tar -C "$R" -czf "$OUT/results.tgz" .
