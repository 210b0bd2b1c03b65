"""`make grpo --model qwen3.5`'s short form: verl's own `main_ppo` on a tiny Qwen3.5 (Gated DeltaNet and
softmax attention; vLLM's CPU build serves it in bf16), ps-bridge with sharing on against ps-bridge with
sharing off (megatron's stock engine does not build Qwen3.5 on a CPU), 3 steps from one seed, and the
verdict's properties.

Needs the grpo stack (`make grpo-venv`); skipped where vLLM is absent. About 11 minutes on 2 cores (the
format fit of the Qwen3.5 model, then two runs)."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_cases import assert_verdict_passed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.grpo,
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("vllm", "verl", "torchvision", "fla")),
                       reason="needs the grpo stack (vLLM's CPU build, verl, torchvision, fla: make grpo-venv)"),
]

ROOT = Path(__file__).resolve().parent.parent


def test_qwen35_short_run_passes_the_verdict(tmp_path):
    from ps_bridge.tools.grpo.launch import cpu_hybrid_rollout_refusal
    from ps_bridge.tools.grpo.report import PROBS_DIFF_MEAN

    refusal = cpu_hybrid_rollout_refusal()
    if refusal:
        pytest.skip(refusal)  # the harness refuses the same (tests/test_grpo_harness.py)

    proc = subprocess.run([sys.executable, "-m", "ps_bridge.tools.grpo", "--model", "qwen3.5", "--short",
                           "--out", str(tmp_path), "--no-plot"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    result = assert_verdict_passed(tmp_path / "qwen3.5" / "verdict.json", proc, "ps-off")
    assert result["runs"] == ["ps", "ps-off"]
    # vLLM's log-probs are finite at every step of both runs (they were NaN from the second step on before
    # ps_bridge.compat.main_ppo_on_cpu zeroed the attention blocks of a hybrid model's shared pool)
    from ps_bridge.tools.grpo import report

    for label in ("ps-off", "ps"):
        run = report.load_run(label, tmp_path / "qwen3.5" / label)
        assert run.step_numbers() == [1, 2, 3]
        assert all(math.isfinite(run.value(k, PROBS_DIFF_MEAN)) for k in run.step_numbers())
