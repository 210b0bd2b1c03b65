#!/usr/bin/env bash
# Expert parallelism on two GPUs of one host, in one run of at most ~10 minutes
# (every step has a time limit). NOT RUN ON GPUS YET: written and checked on a CPU only
# (`bench --smoke --ep 2` under torchrun with gloo, tests/test_expert_parallel.py).
#   OUT=... tools/gpu_ep.sh
# 1. tools/gpu_checks.sh tests/test_grouped_experts.py: unpacks the stack, installs the repo
#    editable, restores / saves Triton's autotune results, runs the grouped_mm GPU tests
#    ($OUT/versions.txt, gpu_tests.log, triton-autotune.tar.gz).
# 2. The EP row of BENCHMARKS.md, `ps-bridge bench` under torchrun (each step its own processes, bf16, random
#    weights, Qwen3.5-35B-A3B shape with 4 of 40 layers, warm-up 1, median of 3):
#    a. EP=2 on two GPUs, (2048, 512, 8) --groups 4: the two ranks are data-parallel, each gets 2
#       whole groups of the 4, shared vs unshared actor step with the gradients reduced over the
#       data-parallel ranks (expert weights over the expert data-parallel group) every step; the
#       experts exchange tokens through megatron's alltoall dispatcher (NCCL). Rank 0 writes the
#       row, `parallel` in its JSON states the layout (world 2, ep 2, data_parallel 2, 2 groups per rank).
#    b. the same share on one GPU without EP (--groups 2, every expert local): what one rank of (a)
#       costs without the expert exchange.
#    Log in $OUT/bench_ep.log, both rows' JSON merged into $OUT/bench_ep.json (rows[].ep says which).
# The command of row (a) alone (repository root, stack installed):
#   torchrun --nproc-per-node 2 -m ps_bridge.tools.cli bench --ep 2 --models qwen3.5-35b-a3b --layers 4 \
#     --grid 2048,512,8 --groups 4 --warmup 1 --repeats 3 --collective-timeout 60 --json bench_ep.json
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
timeout 100 tools/gpu_checks.sh tests/test_grouped_experts.py
source tools/gpu_env.sh
ROWS=/tmp/ps-bridge-ep-rows
rm -rf "$ROWS" && mkdir -p "$ROWS"
bench() { bench_step "$OUT/bench_ep.log" "$ROWS" ep "$@"; }  # bench LIMIT_S NPROC ARGS...
# fla compiles and autotunes its GDN kernels for this shape on a fresh machine (minutes): generous limits
ROW=(--models qwen3.5-35b-a3b --layers 4 --grid 2048,512,8 --warmup 1 --repeats 3)
bench 300 2 --ep 2 --groups 4 "${ROW[@]}"
bench 150 1 --groups 2 "${ROW[@]}"
python3 tools/merge_bench_rows.py "$ROWS" "$OUT/bench_ep.json"
echo "gpu_ep.sh done in $SECONDS s" | tee -a "$OUT/bench_ep.log"
