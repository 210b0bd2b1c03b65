#!/usr/bin/env bash
# All GPU checks and benchmarks in one run, on a GPU machine whose image has torch, triton and
# transformers but not the rest of our stack (for anyone with GPUs and no package index: no
# megatron, no fla). The rest travels as one archive, `.whl/gpusite.tar.xz` (git-ignored): the
# unpacked cp312 wheels of megatron-core 0.19.2, megatron-bridge 0.6.2, fla-core 0.6.0, omegaconf,
# antlr4, and tilelang 0.1.15 with apache-tvm-ffi, torch-c-dlpack-ext and z3-solver (fla's GDN
# backward on Hopper with Triton < 3.7.1 needs tilelang). xz fits them in a 64 MiB upload.
# Build it with tools/build_gpu_site.sh.
#
# Usage (repository root): tools/gpu_checks.sh [pytest selection...] [-- bench args...]
# The single-GPU test set (one GPU; tests/test_parallel_gpu.py needs two):
#   tools/gpu_checks.sh tests/test_attention_backends.py tests/test_bf16_vs_fp32_gpu.py tests/test_gdn_fla_gpu.py
# Results land in $OUT: versions.txt, gpu_tests.log (pytest output, the 15 slowest tests, the wall
# times), bench.json / bench.png / bench.log, and triton-autotune.tar.gz: the kernel caches worth
# carrying, Triton's autotune results (fla's GDN kernels autotune for minutes per head configuration
# and dtype on a fresh machine) and tilelang's compiled kernels (fla's Hopper GDN backward, ~16 s
# each). Copy that file to .whl/ and carry it next time: the kernels then compile only the chosen
# config. The archive is refreshed every 20 s, so a run cut short still returns it.
#
# The tests run as three pytest processes at once on the one GPU, split by kernel configuration:
# the float32 GDN tests, the bfloat16 GDN tests (each autotunes fla's kernels for its dtype, mostly
# CPU-bound compilation), and the rest (attention backends; FlexAttention compiles). Every selected
# test runs in exactly one of them (the third is "neither of the first two"). GPU_TEST_SPLIT=0, or a
# selection with options (-k, -m, ...), runs one process instead.
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
# GPUSITE picks the stack's archive (tools/build_gpu_site.sh): .whl/gpusite.tar.xz (newest, the
# default) or .whl/gpusite-oldest.tar.xz (oldest); both unpack to /tmp/gpusite
GPUSITE=${GPUSITE:-.whl/gpusite.tar.xz}
if [ -f "$GPUSITE" ]; then
  rm -rf /tmp/gpusite
  tar -C /tmp -xJf "$GPUSITE" || exit 1
fi
source tools/gpu_env.sh
install_editable || exit 1
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .whl/triton-autotune.tar.gz ]; then
  tar -C "$TRITON_CACHE_DIR" -xzf .whl/triton-autotune.tar.gz \
    && echo "kernel caches restored: $(find "$TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l) Triton autotune results, $(du -sh "$TILELANG_CACHE_DIR" 2>/dev/null | cut -f1) of tilelang kernels"
fi
( while sleep 20; do save_autotune; done ) &
saver=$!
part_pids=()
trap 'kill $saver "${part_pids[@]}" 2>/dev/null; save_autotune' EXIT
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers, megatron.core, fla; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__, 'fla', fla.__version__)"
  python3 -c "import tilelang; print('tilelang', tilelang.__version__)"
} 2>&1 | tee "$OUT/versions.txt"

tests=(); bench=()
while [ "$#" -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; bench=("$@"); break; fi
  tests+=("$1"); shift
done
# -k expressions naming the GDN tests of each dtype (their test ids; see the header)
GDN_FP32='test_fla_matches_torch_ref and float32 or test_model_fla_matches_torch_ref'
GDN_BF16='test_fla_matches_torch_ref and bfloat16 or test_qwen35_bf16_shared'
# one pytest process: part name, then pytest arguments; writes $OUT/gpu_tests.<name>.log
mkdir -p /tmp/ps-bridge-pytest
run_part() {
  local name=$1 t0=$SECONDS rc; shift
  TORCHDYNAMO_DISABLE=1 python3 -m pytest -q -s -ra -m gpu -p no:cacheprovider --durations=15 \
    --basetemp="/tmp/ps-bridge-pytest/$name" "$@" >"$OUT/gpu_tests.$name.log" 2>&1
  rc=$?
  echo "[$name] pytest exit $rc, wall $((SECONDS - t0)) s" >>"$OUT/gpu_tests.$name.log"
  return $rc
}
if [ "${#tests[@]}" -gt 0 ]; then
  names=(); t0=$SECONDS; split=${GPU_TEST_SPLIT:-1}
  for arg in "${tests[@]}"; do case $arg in -*) split=0 ;; esac; done
  if [ "$split" = 1 ]; then
    names=(gdn-float32 gdn-bfloat16 other)
    run_part gdn-float32 -k "$GDN_FP32" "${tests[@]}" & part_pids+=($!)
    run_part gdn-bfloat16 -k "($GDN_BF16) and not ($GDN_FP32)" "${tests[@]}" & part_pids+=($!)
    run_part other -k "not ($GDN_FP32) and not ($GDN_BF16)" "${tests[@]}" & part_pids+=($!)
  else
    names=(all)
    run_part all "${tests[@]}" & part_pids+=($!)
  fi
  status=0; ran=0
  for i in "${!part_pids[@]}"; do
    wait "${part_pids[$i]}"; rc=$?
    # 5: this part selected no test (e.g. a selection without GDN tests)
    if [ "$rc" -ne 5 ]; then ran=1; [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc; fi
  done
  part_pids=()
  pytest_wall=$((SECONDS - t0))
  [ "$ran" = 1 ] || status=5
  {
    echo "selection: ${tests[*]}"
    for name in "${names[@]}"; do
      echo "===== pytest part $name ====="
      cat "$OUT/gpu_tests.$name.log"
    done
    echo "===== wall times ====="
    for name in "${names[@]}"; do tail -n 1 "$OUT/gpu_tests.$name.log"; done
    echo "pytest wall time (${#names[@]} process(es) at once): $pytest_wall s; exit status $status"
    echo "script wall time so far (unpack, install, versions, pytest): $SECONDS s"
    save_autotune
    size=$(stat -c %s "$OUT/triton-autotune.tar.gz" 2>/dev/null || echo 0)
    echo "triton-autotune.tar.gz: $((size / 1024)) KiB"
    [ "$size" -gt $((15 * 1024 * 1024)) ] && echo "WARNING: over 15 MiB; with gpusite.tar.xz it may not fit a 64 MiB upload"
  } >"$OUT/gpu_tests.log"
  for name in "${names[@]}"; do rm -f "$OUT/gpu_tests.$name.log"; done
  cat "$OUT/gpu_tests.log"
fi
bench_status=0
if [ "${#bench[@]}" -gt 0 ]; then
  python3 -m ps_bridge.tools.cli bench --no-progress --json "$OUT/bench.json" --plot "$OUT/bench.png" "${bench[@]}" 2>&1 | tee "$OUT/bench.log"
  bench_status=$?
fi
# the tests' exit status, else the bench's
[ "${status:-0}" -ne 0 ] && exit "$status"
exit "$bench_status"
