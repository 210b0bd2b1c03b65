#!/usr/bin/env bash
# Build .whl/gpusite.tar.xz (git-ignored), the one archive scripts/gpu_checks.sh unpacks on a GPU
# machine that has torch/triton/transformers but no internet: our stack's cp312 wheels (and verl's
# engine path: verl, tensordict and their small pure-Python needs), unpacked
# into one folder and xz-compressed so they fit one device call's 64 MiB (about 48 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$work/whl" megatron-core==0.19.2 megatron-bridge==0.6.2 fla-core==0.6.0 omegaconf==2.3.0 \
  tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0 \
  verl==0.9.1 tensordict==0.10.0 cloudpickle==3.1.3 importlib_metadata==10.2.0 zipp==4.1.2 \
  lazy-importer==0.1.0 orjson==3.13.0 pyvers==0.1.0 codetiming==1.4.0
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$work/whl"   # sdist only
mkdir -p "$work/gpusite" .whl
for w in "$work"/whl/*.whl; do (cd "$work/gpusite" && unzip -q -o "$w"); done
tar -C "$work" -cf - gpusite | xz -T0 -9 > .whl/gpusite.tar.xz
rm -rf "$work"
ls -la .whl/gpusite.tar.xz
