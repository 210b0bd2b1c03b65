#!/usr/bin/env bash
# Build the one archive tools/gpu_checks.sh unpacks on a GPU machine that has torch/triton/transformers
# but no internet: a stack's cp312 wheels (and verl's engine path: verl, tensordict and their small
# pure-Python needs), unpacked into one folder and xz-compressed so they fit a 64 MiB upload.
#   tools/build_gpu_site.sh               -> .whl/gpusite.tar.xz         (the newest stack, about 48 MB)
#   STACK=oldest tools/build_gpu_site.sh  -> .whl/gpusite-oldest.tar.xz  (the oldest stack, docs/install.md)
# Both are git-ignored; gpu_checks.sh unpacks whichever it is given (GPUSITE=.whl/gpusite-oldest.tar.xz).
set -euo pipefail
cd "$(dirname "$0")/.."
STACK=${STACK:-newest}
common=(omegaconf==2.3.0 cloudpickle==3.1.3 importlib_metadata==10.2.0 zipp==4.1.2 lazy-importer==0.1.0
        orjson==3.13.0 pyvers==0.1.0 codetiming==1.4.0 tensordict==0.10.0)
case "$STACK" in
  newest)
    archive=.whl/gpusite.tar.xz
    stack=(megatron-core==0.19.2 megatron-bridge==0.6.2 fla-core==0.6.0 verl==0.9.1
           tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0) ;;
  oldest)
    # the GPU machine's torch stays; transformers travels (Megatron-Bridge 0.5.0 wants 5.8.x) with a
    # tokenizers it accepts (<= 0.23.0; the image has 0.23.2), and
    # modelopt with what its import needs (Megatron-Bridge 0.5.0 imports it at import time; pydantic
    # is not on the GPU image)
    archive=.whl/gpusite-oldest.tar.xz
    stack=(megatron-core==0.18.0 megatron-bridge==0.5.0 fla-core==0.4.2 verl==0.8.0 transformers==5.8.1 tokenizers==0.22.2
           nvidia-modelopt==0.43.0 requests==2.34.2 urllib3==2.8.0 pulp==4.2.0 orloge==1.0.0 cpsat-logutils==1.0.0
           pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5) ;;
  *) echo "STACK=$STACK is not a tested stack: use STACK=newest or STACK=oldest" >&2; exit 2 ;;
esac
work=$(mktemp -d)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$work/whl" "${stack[@]}" "${common[@]}"
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$work/whl"   # sdist only
mkdir -p "$work/gpusite" .whl
for w in "$work"/whl/*.whl; do (cd "$work/gpusite" && unzip -q -o "$w"); done
tar -C "$work" -cf - gpusite | xz -T0 -9 > "$archive"
rm -rf "$work"
ls -la "$archive"
