#!/usr/bin/env bash
# `ps-bridge bench` runs before and after a change, in one call on one GPU machine: each bench of
# BENCHES (bench arguments, `|`-separated) with the revision archived in .wt/base installed, then with
# this checkout installed. The caller archives the base revision:
#   rm -rf .wt/base && mkdir -p .wt/base && git archive REV | tar -x -C .wt/base
# (.wt/ is git-ignored; name it in `carry`).
#
# Usage (repository root): BENCHES="--models qwen3.5-35b-a3b --groups 4 --grid 2048,512,8|--models qwen2.5-7b --trees chain" \
#   tools/gpu_before_after.sh
# SIDES=after runs the checkout's side only (default "before after").
# $OUT gets: versions.txt, bench_{before,after}_<k>.json (k: the bench's place in BENCHES), bench.log
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
LIMIT=${LIMIT:-110}  # seconds per bench
# the first bench of the call also compiles the Triton kernels the carried autotune cache does not hold
# (fla's, torch.compile's): it gets FIRST_LIMIT seconds
FIRST_LIMIT=${FIRST_LIMIT:-$((2 * LIMIT))}
mkdir -p "$OUT"
source tools/gpu_env.sh
gpu_setup || exit 1
cat "$OUT/versions.txt"
IFS='|' read -r -a benches <<<"${BENCHES:?BENCHES: bench arguments, |-separated}"
SIDES=${SIDES:-before after}
for side in $SIDES; do
  dir=.; [ "$side" = before ] && dir=.wt/base
  install_editable "$dir" || exit 1
  for k in "${!benches[@]}"; do
    read -r -a bench_args <<<"${benches[$k]}"
    limit=$LIMIT; [ "$k" = 0 ] && [ "$side" = "${SIDES%% *}" ] && limit=$FIRST_LIMIT
    (cd "$dir" && timeout "$limit" python3 -m ps_bridge.tools.cli bench --no-progress "${bench_args[@]}" \
      --json "$OUT/bench_${side}_$k.json") >>"$OUT/bench.log" 2>&1
    echo "=== [$SECONDS s] $side, bench $k (${benches[$k]}): exit $?" | tee -a "$OUT/bench.log"
  done
done
install_editable
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "bench_*.json"))):
    for r in json.load(open(path))["rows"]:
        if r.get("error"):
            print(f"{os.path.basename(path):22s} {r['model']:16s} {r.get('tree')}: {r['error']}")
            continue
        shape = r.get("tree") or (r["P"], r["R"], r["n"])
        print(f"{os.path.basename(path):22s} {r['model']:16s} {shape} x{r['groups']}: actor {r['actor_speedup']:.2f}x "
              f"= {r['actor_speedup'] / r['flop_ratio']:.3f} F (F {r['flop_ratio']:.2f}), "
              f"shared {r['shared']['actor_ms']:.1f} ms, unshared {r['unshared']['actor_ms']:.1f} ms")
PY
echo "=== [$SECONDS s] done"
