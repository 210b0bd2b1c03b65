# Sourced by scripts/gpu_checks.sh and scripts/gpu_cp.sh (repository root): the environment our
# stack runs in on the lent GPU machine, from the archive `.whl/gpusite.tar.xz` unpacked to
# /tmp/gpusite, and `save_autotune`, which keeps the kernel caches worth carrying in $OUT.
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
