#!/usr/bin/env bash
# The Qwen3.5 MoE GPU work in one call on one H200 (nvidia-h200), built on tools/gpu_checks.sh
# (which unpacks .whl/gpusite.tar.xz, installs the repository editable, restores the Triton autotune
# cache from .whl/triton-autotune.tar.gz and runs the selected `-m gpu` tests). About 5-7 minutes.
#
# Usage (repository root): tools/gpu_moe.sh
# $OUT gets (8 files):
#   versions.txt, gpu_tests.log      from gpu_checks.sh (tests/test_grouped_experts.py and
#                                    tests/test_token_permutation.py, -m gpu: grouped_mm, the fused SwiGLU,
#                                    the alltoall layer vs megatron's permutation, no host sync)
#   moe_layer.json / moe_layer.log   the MoE layer alone, Qwen3.5-35B-A3B shape, bf16, forward + backward,
#                                    grouped experts vs megatron's SequentialMLP, 4 x (2048 + 8 x 512) tokens;
#                                    the log ends with torch.profiler's table of one grouped step
#   bench_g4.json                    actor step shared vs unshared, 35B-A3B shape (4 of 40 layers), (2048, 512, 8) --groups 4
#   bench_long.json                  the same at (512, 4096, 8), one group
#   bench.log                        both bench runs' output
#   triton-autotune.tar.gz           Triton's autotune results after everything (carry it next time)
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
tools/gpu_checks.sh tests/test_grouped_experts.py tests/test_token_permutation.py; tests_status=$?
source tools/gpu_env.sh
timeout 150 python3 -m ps_bridge.tools.bench.moe_layer --json "$OUT/moe_layer.json" --profile /tmp/moe_profile.txt 2>&1 | grep -v "^WARNING\|warn" | tee "$OUT/moe_layer.log"
cat /tmp/moe_profile.txt >> "$OUT/moe_layer.log"
bench=(python3 -m ps_bridge.tools.cli bench --no-progress --models qwen3.5-35b-a3b --warmup 1 --repeats 3)
timeout 200 "${bench[@]}" --grid 2048,512,8 --groups 4 --json "$OUT/bench_g4.json" 2>&1 | tee "$OUT/bench.log"
timeout 150 "${bench[@]}" --grid 512,4096,8 --json "$OUT/bench_long.json" 2>&1 | tee -a "$OUT/bench.log"
save_autotune
exit "$tests_status"
