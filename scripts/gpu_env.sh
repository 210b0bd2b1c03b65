# Sourced by scripts/gpu_checks.sh and scripts/gpu_cp.sh (repository root): the environment our
# stack runs in on the lent GPU machine, from the archive `.whl/gpusite.tar.xz` unpacked to
# /tmp/gpusite, and `save_autotune`, which keeps Triton's autotune results in $OUT.
export PYTHONPATH="/tmp/gpusite" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export TRITON_CACHE_DIR=/tmp/triton-cache FLA_CACHE_RESULTS=1
save_autotune() {
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar --null -czf "$OUT/.autotune.tmp" -T - \
    && mv "$OUT/.autotune.tmp" "$OUT/triton-autotune.tar.gz") 2>/dev/null
}
