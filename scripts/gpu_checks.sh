#!/usr/bin/env bash
# All GPU checks and benchmarks in one call, on a GPU machine whose image has torch, triton and
# transformers but not the rest of our stack (the H200 lent to this project: no internet, no
# megatron, no fla). The rest travels as one archive, `.whl/gpusite.tar.xz` (git-ignored): the
# unpacked cp312 wheels of megatron-core 0.19.2, megatron-bridge 0.6.2, fla-core 0.6.0, omegaconf,
# antlr4, and tilelang 0.1.15 with apache-tvm-ffi, torch-c-dlpack-ext and z3-solver (fla's GDN
# backward on Hopper with Triton < 3.7.1 needs tilelang). xz fits them in one call's 64 MiB.
# Build it with scripts/build_gpu_site.sh.
#
# Usage (repository root): scripts/gpu_checks.sh [pytest selection...] [-- bench args...]
# Results land in $OUT: versions.txt, gpu_tests.log, bench.json / bench.png / bench.log.
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
if [ -f .whl/gpusite.tar.xz ]; then
  tar -C /tmp -xJf .whl/gpusite.tar.xz || exit 1
fi
export PYTHONPATH="/tmp/gpusite:$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
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
if [ "${#tests[@]}" -gt 0 ]; then
  TORCHDYNAMO_DISABLE=1 python3 -m pytest -q -s -ra -m gpu -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [ "${#bench[@]}" -gt 0 ]; then
  python3 -m ps_bridge.cli bench --no-progress --json "$OUT/bench.json" --plot "$OUT/bench.png" "${bench[@]}" 2>&1 | tee "$OUT/bench.log"
fi
