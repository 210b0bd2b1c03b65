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
# Results land in $OUT: versions.txt, gpu_tests.log, bench.json / bench.png / bench.log, and
# triton-autotune.tar.gz: Triton's autotune results (fla's GDN kernels autotune for minutes on a
# fresh machine). Copy that file to .whl/ and carry it next time: the kernels then compile only
# the chosen config. The archive is refreshed every 20 s, so a run cut short still returns it.
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
if [ -f .whl/gpusite.tar.xz ]; then
  tar -C /tmp -xJf .whl/gpusite.tar.xz || exit 1
fi
source scripts/gpu_env.sh
# ps_bridge (with providers/ and models/ mapped into it by pyproject.toml) through an editable
# install, offline: no build isolation, no dependencies
python3 -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e . >/tmp/ps-bridge-install.log 2>&1 \
  || { cat /tmp/ps-bridge-install.log; echo "editable install of ps-bridge failed"; exit 1; }
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .whl/triton-autotune.tar.gz ]; then
  tar -C "$TRITON_CACHE_DIR" -xzf .whl/triton-autotune.tar.gz && echo "triton autotune results restored"
fi
( while sleep 20; do save_autotune; done ) &
saver=$!
trap 'kill $saver 2>/dev/null; save_autotune' EXIT
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
