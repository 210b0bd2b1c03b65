#!/usr/bin/env bash
# Context parallelism on two GPUs, of one host, in one run of at most ~8 minutes (every
# step has a time limit):
#   OUT=... tools/gpu_cp.sh
# 1. tools/gpu_checks.sh tests/test_context_parallel_gpu.py: unpacks the stack, installs the repo
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
timeout 110 tools/gpu_checks.sh tests/test_context_parallel_gpu.py
source tools/gpu_env.sh
ROWS=/tmp/ps-bridge-cp-rows
rm -rf "$ROWS" && mkdir -p "$ROWS"
bench() { bench_step "$OUT/bench_cp.log" "$ROWS" cp "$@"; }  # bench LIMIT_S NPROC ARGS...
COMMON=(--warmup 1 --repeats 2 --layers 4)
bench 80 2 --cp 2 --models qwen2.5-7b --grid "32768,1024,8" --max-tokens-per-gpu 60000 "${COMMON[@]}"
bench 85 2 --cp 2 --models qwen2.5-7b --grid "65536,512,8" --max-tokens-per-gpu 60000 "${COMMON[@]}"
bench 75 2 --cp 2 --models qwen3.5-9b --grid "32768,1024,8" --max-tokens-per-gpu 60000 "${COMMON[@]}"
LADDER=(--models qwen2.5-7b --shared-only --stop-on-failure --warmup 0 --repeats 1 --layers 4)
bench 60 1 "${LADDER[@]}" --grid "65536,1024,8;81920,1024,8;98304,1024,8;114688,1024,8"
bench 75 2 --cp 2 "${LADDER[@]}" --grid "131072,1024,8;163840,1024,8;196608,1024,8;229376,1024,8"
python3 tools/merge_bench_rows.py "$ROWS" "$OUT/bench_cp.json"
echo "gpu_cp.sh done in $((SECONDS - start)) s" | tee -a "$OUT/bench_cp.log"
