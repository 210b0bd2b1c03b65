#!/usr/bin/env bash
# Prefix trees on one GPU in one run, inside a time budget (BUDGET_S):
#   1. the tree GPU tests (bf16 vs the float32 twin for the tree cascade and fla's per-level GDN,
#      fla vs torch_ref on a tree, and the depth-one cascade / fla kernel tests as a regression
#      check), through tools/gpu_checks.sh (which unpacks .whl/gpusite.tar.xz and restores
#      .whl/triton-autotune.tar.gz), cut at TESTS_S seconds;
#   2. `ps-bridge bench` on the Qwen2.5-7B shape (4 layers): today's (2048, 512, 8) row, then the tree
#      rows chain, search, system; then the Qwen3.5-9B shape's tree rows, each cut so that the whole
#      script ends by BUDGET_S seconds (every finished row is in its JSON: written after each row).
# Usage (repository root): tools/gpu_tree.sh. Results in $OUT: results.tar.gz (every log and JSON)
# and triton-autotune.tar.gz; the summary is printed.
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-390}
TESTS_S=${TESTS_S:-170}
WARMUP=${WARMUP:-1}
REPEATS=${REPEATS:-2}
MAX_TOKENS=${MAX_TOKENS:-90000}  # the largest tree row's shared pack is 88,064 tokens (search)

timeout -k 10 "$TESTS_S" tools/gpu_checks.sh \
  "tests/test_attention_backends.py::test_gpu_cascade_on_trees_bf16_matches_fp32_reference" \
  "tests/test_attention_backends.py::test_gpu_flash_bf16_matches_fp32_reference" \
  "tests/test_gdn_fla_gpu.py::test_fla_matches_torch_ref_on_trees" \
  "tests/test_gdn_fla_gpu.py::test_fla_matches_torch_ref" \
  "tests/test_bf16_vs_fp32_gpu.py::test_qwen2_bf16_shared_is_as_close_to_fp32_as_unshared[tree]" \
  "tests/test_bf16_vs_fp32_gpu.py::test_qwen35_bf16_shared_is_as_close_to_fp32_as_unshared[tree]"
echo "=== tests exit $? at $SECONDS s"
source tools/gpu_env.sh

bench() {  # bench TAG ARGS...: one bench process, cut so that the script ends by BUDGET_S
  local tag=$1 left=$((BUDGET_S - SECONDS)); shift
  if [ "$left" -lt 30 ]; then echo "=== bench $tag not run: $left s left"; return; fi
  echo "=== [$SECONDS s] bench $tag (limit $left s): $*"
  timeout -k 5 "$left" python3 -m ps_bridge.tools.cli bench --no-progress --warmup "$WARMUP" --repeats "$REPEATS" \
    --max-tokens-per-gpu "$MAX_TOKENS" --json "$OUT/bench-$tag.json" "$@" 2>&1 | tee "$OUT/bench-$tag.log"
  echo "=== bench $tag exit ${PIPESTATUS[0]} at $SECONDS s"
  save_autotune
}
bench qwen25-7b --models qwen2.5-7b --grid 2048,512,8 --trees chain,search,system
bench qwen35-9b --models qwen3.5-9b --trees chain,search,system

save_autotune
cd "$OUT" && tar -czf results.tar.gz --remove-files $(ls | grep -v -e '^triton-autotune.tar.gz$' -e '^results.tar.gz$')
ls -la "$OUT"
