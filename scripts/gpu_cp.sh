#!/usr/bin/env bash
# Context parallelism on two GPUs, in one call of at most ~8 minutes (every step has a time limit;
# machine kind nvidia-h200-x2):
#   OUT=... scripts/gpu_cp.sh
# 1. scripts/gpu_checks.sh tests/test_context_parallel_gpu.py: unpacks the stack, installs the repo
#    editable, restores / saves Triton's autotune results, runs the CP=2 bf16-vs-float32 GPU test
#    ($OUT/versions.txt, gpu_tests.log, triton-autotune.tar.gz).
# 2. `ps-bridge bench` under torchrun, every step in its own processes (an out-of-memory rank that
#    hangs its NCCL peer costs that step only: `timeout`, --collective-timeout), bf16, 4 layers:
#    a. qwen2.5-7b (32768, 1024, 8) and (65536, 512, 8): shared CP=2 vs unshared CP=2 on the same
#       samples (the unshared batch split into micro-batches of at most 60000 packed tokens per GPU);
#    b. qwen3.5-9b (32768, 1024, 8), the same;
#    c. the longest P at n=8, R=1024 whose shared actor step fits: growing P, shared only, at CP=1
#       (one GPU) and at CP=2, each stopping at the first P that does not fit.
#    Logs in $OUT/bench_cp.log, every row's JSON merged into $OUT/bench_cp.json (rows[].cp says which).
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
start=$SECONDS
timeout 110 scripts/gpu_checks.sh tests/test_context_parallel_gpu.py
source scripts/gpu_env.sh
ROWS=/tmp/ps-bridge-cp-rows
rm -rf "$ROWS" && mkdir -p "$ROWS"
step=0
bench() {  # bench LIMIT_S NPROC ARGS...: one bench process group, its JSON kept apart
  local limit=$1 nproc=$2; shift 2
  step=$((step + 1))
  echo "=== [$((SECONDS - start)) s] bench step $step (nproc $nproc): $*" | tee -a "$OUT/bench_cp.log"
  timeout -k 10 "$limit" python3 -m torch.distributed.run --nproc-per-node "$nproc" -m ps_bridge.cli bench \
    --no-progress --collective-timeout 45 --json "$ROWS/step$step-cp$nproc.json" "$@" >> "$OUT/bench_cp.log" 2>&1
  echo "=== step $step exit $?" | tee -a "$OUT/bench_cp.log"
  save_autotune
}
COMMON=(--warmup 1 --repeats 2 --layers 4)
bench 80 2 --cp 2 --models qwen2.5-7b --grid "32768,1024,8" --max-tokens-per-gpu 60000 "${COMMON[@]}"
bench 85 2 --cp 2 --models qwen2.5-7b --grid "65536,512,8" --max-tokens-per-gpu 60000 "${COMMON[@]}"
bench 75 2 --cp 2 --models qwen3.5-9b --grid "32768,1024,8" --max-tokens-per-gpu 60000 "${COMMON[@]}"
LADDER=(--models qwen2.5-7b --shared-only --stop-on-failure --warmup 0 --repeats 1 --layers 4)
bench 60 1 "${LADDER[@]}" --grid "65536,1024,8;81920,1024,8;98304,1024,8;114688,1024,8"
bench 75 2 --cp 2 "${LADDER[@]}" --grid "131072,1024,8;163840,1024,8;196608,1024,8;229376,1024,8"
python3 - "$ROWS" "$OUT/bench_cp.json" <<'PY'
import glob, json, os, re, sys
rows, first = [], None
for path in sorted(glob.glob(os.path.join(sys.argv[1], "step*.json")), key=lambda p: int(re.search(r"step(\d+)", p).group(1))):
    data = json.load(open(path))
    first = first or data
    cp = int(re.search(r"cp(\d+)", os.path.basename(path)).group(1))
    rows += [dict(row, cp=cp) for row in data["rows"]]
json.dump(dict(first or {}, rows=rows), open(sys.argv[2], "w"), indent=2)
print(f"{len(rows)} rows merged into {sys.argv[2]}")
PY
echo "gpu_cp.sh done in $((SECONDS - start)) s" | tee -a "$OUT/bench_cp.log"
