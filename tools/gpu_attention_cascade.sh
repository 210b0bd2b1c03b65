#!/usr/bin/env bash
# The cascade attention's side-stream modes (ps_bridge/kernels/attention/cascade.py, `OVERLAP`,
# `OVERLAP_PASSES`) on one H200, all in one call: the Qwen3 bench rows under each mode, then the GPU
# attention tests under the two stream modes.
#
# Usage (repository root): tools/gpu_attention_cascade.sh
# $OUT gets: versions.txt, bench_<mode>_{qwen3_8b,qwen3_30b_a3b}.json, bench.log, gpu_tests.log
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
source tools/gpu_env.sh
gpu_setup || exit 1
cat "$OUT/versions.txt"
echo "=== [$SECONDS s] set up" | tee "$OUT/bench.log"
args=(bench --no-progress --layers 4 --warmup 2 --repeats 5)
with_mode() {  # with_mode MODE PASSES: python code setting the switches, then the CLI on the arguments
  echo "import sys; import ps_bridge.kernels.attention.cascade as c; c.OVERLAP = '$1'; c.OVERLAP_PASSES = ($2); from ps_bridge.tools.cli import main; sys.exit(main(sys.argv[1:]))"
}
run_bench() {  # run_bench TAG MODE PASSES MODELS...
  local tag=$1 mode=$2 passes=$3; shift 3
  for model in "$@"; do
    local grid=("--grid" "2048,512,8;4096,256,16")
    [ "$model" = qwen3-30b-a3b ] && grid=(--groups 4 --grid 2048,512,8)
    timeout 120 python3 -c "$(with_mode "$mode" "$passes")" "${args[@]}" --models "$model" "${grid[@]}" \
      --json "$OUT/bench_${tag}_${model}.json" >>"$OUT/bench.log" 2>&1
    echo "=== [$SECONDS s] $tag $model exit $?" >>"$OUT/bench.log"
  done
}
both="'forward', 'backward'"
run_bench off off "$both" qwen3-8b qwen3-30b-a3b
run_bench ancestors ancestors "$both" qwen3-8b qwen3-30b-a3b
run_bench segments segments "$both" qwen3-8b qwen3-30b-a3b
run_bench segments_bwd segments "'backward',"  qwen3-8b
run_bench ancestors_bwd ancestors "'backward',"  qwen3-8b
grep "===" "$OUT/bench.log"
python3 - "$OUT" <<'EOF2'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "bench_*.json"))):
    for r in json.load(open(path))["rows"]:
        print(f"{os.path.basename(path):40s} ({r['P']},{r['R']},{r['n']}) x{r['groups']}: actor {r['actor_speedup']:.2f}x "
              f"= {r['actor_speedup'] / r['flop_ratio']:.3f} F, log-prob {r['logprob_speedup']:.2f}x, "
              f"shared {r['shared']['actor_ms']:.1f} ms, unshared {r['unshared']['actor_ms']:.1f} ms")
EOF2
mkdir -p /tmp/ps-bridge-pytest
for mode in segments ancestors; do
  TORCHDYNAMO_DISABLE=1 timeout 60 python3 -c "import sys, pytest; import ps_bridge.kernels.attention.cascade as c; c.OVERLAP = '$mode'; sys.exit(pytest.main(sys.argv[1:]))" \
    -q -ra -m gpu -p no:cacheprovider --basetemp=/tmp/ps-bridge-pytest/$mode tests/test_attention_backends.py -k "cascade or flash or auto" \
    >>"$OUT/gpu_tests.log" 2>&1
  echo "=== [$SECONDS s] gpu tests, OVERLAP=$mode: exit $?" >>"$OUT/gpu_tests.log"
done
grep "passed\|failed\|===" "$OUT/gpu_tests.log" | tail -6
echo "=== [$SECONDS s] done"
