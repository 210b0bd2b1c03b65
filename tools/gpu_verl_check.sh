#!/usr/bin/env bash
# `ps-bridge verl-check` on one GPU (an H200 here), bf16, reduced layers (4):
# verl 0.9.1's own trainer step, stock Megatron engine vs prefix-shared, for the Qwen2.5-7B and
# Qwen3.5-9B shapes at the settings of BENCHMARKS.md: 32 prompts x n=8, P=2048, R drawn from [256, 768]
# (mean 512), mini-batch of 8 prompts, ppo_max_token_len_per_gpu=16384, log-prob budgets 32768 (the
# same numbers for both engines), 3 trainer steps (the first is left out of the speed-ups), plus the
# stock-vs-stock noise floor (stock at 3/4 of every budget) on the Qwen2.5-7B shape.
#
# Usage (repository root, about 7-8 minutes): tools/gpu_verl_check.sh
# Built on tools/gpu_checks.sh (sourced: unpacks .whl/gpusite.tar.xz, installs the repo editable,
# restores and saves Triton's autotune results, writes versions.txt). Results in $OUT (8 files):
#   versions.txt                 GPU, torch/triton/transformers/megatron/fla, then verl/tensordict
#   triton-autotune.tar.gz       Triton autotune cache for the next run (copy to .whl/)
#   verl_check.log               both runs' printed tables (per step diffs, losses, phase times)
#   verl_check_qwen2.5-7b.json   per-step JSON (schema: docs/verl.md), with "noise_floor"
#   verl_check_qwen2.5-7b.png    curves: loss / grad norm per optimizer step, phase times, diffs
#   verl_check_qwen3.5-9b.json / .png   the same for the Qwen3.5-9B shape (no noise floor)
set --
# shellcheck source=gpu_checks.sh
source "$(dirname "$0")/gpu_checks.sh"

# verl on this image (transformers differs from our pinned one): versions, then the engine path
python3 - <<'PY' 2>&1 | tee -a "$OUT/versions.txt"
import sys
try:
    import tensordict, transformers, verl
    print("verl", verl.__version__, "tensordict", tensordict.__version__, "transformers", transformers.__version__)
    from ps_bridge.tools.verl_check.side_by_side import prepare_side_by_side
    prepare_side_by_side()
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # noqa: F401
    from verl.workers.utils.losses import ppo_loss  # noqa: F401
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: F401
    import ps_bridge.verl.engine  # noqa: F401
    print("verl engine path imports: ok")
except Exception as e:
    print(f"FAILED: verl's engine path does not import here ({type(e).__name__}: {e}); "
          "rebuild .whl/gpusite.tar.xz (tools/build_gpu_site.sh) with the missing package")
    sys.exit(3)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 3

COMMON=(--no-progress --workdir /tmp/verl-check --layers 4 --prompts 32 --n 8 --prompt-len 2048 --response-len 512
        --steps 3 --dtype bfloat16
        actor_rollout_ref.actor.ppo_mini_batch_size=8
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
        actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768
        actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768)
check() {  # NAME SECONDS ARGS...: one verl-check run, cut at SECONDS so the next one still runs
  local name=$1 limit=$2; shift 2
  echo "=== verl-check $name ($(date +%T), limit ${limit}s)" | tee -a "$OUT/verl_check.log"
  timeout "$limit" python3 -m ps_bridge.tools.cli verl-check --model "$name" --json "$OUT/verl_check_$name.json" \
    --plot "$OUT/verl_check_$name.png" "$@" "${COMMON[@]}" 2>&1 | tee -a "$OUT/verl_check.log"
  echo "=== $name exit ${PIPESTATUS[0]} ($(date +%T))" | tee -a "$OUT/verl_check.log"
}
check qwen2.5-7b 220 --noise-floor   # its JSON is written before the noise floor starts
check qwen3.5-9b 180
