# Sourced by the tools/gpu_*.sh scripts (repository root): the environment our
# stack runs in on a GPU machine without a package index, from the archive `.whl/gpusite.tar.xz` unpacked to
# /tmp/gpusite; `save_autotune`, which keeps the kernel caches worth carrying in $OUT; and
# `bench_step`, one `ps-bridge bench` under torchrun.
export PYTHONPATH="/tmp/gpusite" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# tilelang's kernel cache lives inside Triton's cache directory, so one archive carries both
export TRITON_CACHE_DIR=/tmp/triton-cache FLA_CACHE_RESULTS=1
export TILELANG_CACHE_DIR="$TRITON_CACHE_DIR/tilelang-kernels"
save_autotune() {
  # Triton's autotune results only (not its compiled kernels: every tried config, too large to
  # carry) and tilelang's finished kernels (written by an atomic rename; skip its staging area)
  (cd "$TRITON_CACHE_DIR" && { find . -name '*.autotune.json' -print0
       [ -d tilelang-kernels ] && find tilelang-kernels -type f ! -path '*/.staging*' ! -name '*.tmp*' -print0; } \
     | tar --null --ignore-failed-read -czf "$OUT/.autotune.tmp" -T - \
     && mv "$OUT/.autotune.tmp" "$OUT/triton-autotune.tar.gz") 2>/dev/null
}
BENCH_STEP=0
bench_step() {
  # bench_step LOG ROWS TAG LIMIT_S NPROC ARGS...: one bench process group under torchrun (an
  # out-of-memory rank that hangs its NCCL peer costs that step only: `timeout`, --collective-timeout),
  # output appended to LOG, its JSON kept apart as ROWS/step<k>-<TAG><NPROC>.json
  # (tools/merge_bench_rows.py merges them)
  local log=$1 rows=$2 tag=$3 limit=$4 nproc=$5; shift 5
  BENCH_STEP=$((BENCH_STEP + 1))
  echo "=== [$SECONDS s] bench step $BENCH_STEP (nproc $nproc): $*" | tee -a "$log"
  timeout -k 10 "$limit" python3 -m torch.distributed.run --nproc-per-node "$nproc" -m ps_bridge.tools.cli bench \
    --no-progress --collective-timeout 45 --json "$rows/step$BENCH_STEP-$tag$nproc.json" "$@" >> "$log" 2>&1
  echo "=== step $BENCH_STEP exit $?" | tee -a "$log"
  save_autotune
}
gpu_setup() {
  # the stack's archive (GPUSITE, default .whl/gpusite.tar.xz) unpacked unless it already is, then
  # prepare_checkout
  [ -d /tmp/gpusite ] || tar -C /tmp -xJf "${GPUSITE:-.whl/gpusite.tar.xz}" || return 1
  prepare_checkout
}
install_editable() {
  # install_editable [DIR]: ps_bridge of DIR (default the checkout; providers/ and models/ mapped into it
  # by pyproject.toml) installed editable, offline: no build isolation, no dependencies
  python3 -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e "${1:-.}" >/tmp/ps-bridge-install.log 2>&1 \
    || { cat /tmp/ps-bridge-install.log; echo "editable install of ps-bridge (${1:-.}) failed"; return 1; }
}
prepare_checkout() {
  # the checkout installed editable (install_editable), the carried kernel caches restored (AUTOTUNE,
  # default .whl/triton-autotune.tar.gz), the stack's versions in $OUT/versions.txt
  install_editable || return 1
  mkdir -p "$TRITON_CACHE_DIR"
  local autotune=${AUTOTUNE:-.whl/triton-autotune.tar.gz}
  [ -f "$autotune" ] && tar -C "$TRITON_CACHE_DIR" -xzf "$autotune"
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    # verl's version from its metadata: `import verl` needs ray, which the GPU machine's stack leaves out
    python3 -c "import importlib.metadata as m, torch, triton, transformers, megatron.core; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__, 'verl', m.version('verl'))"
  } >"$OUT/versions.txt" 2>&1
  return 0
}
