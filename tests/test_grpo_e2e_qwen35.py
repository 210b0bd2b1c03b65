"""`make grpo --model qwen3.5`'s short form: verl's own `main_ppo` on a tiny Qwen3.5 (Gated DeltaNet and
softmax attention; vLLM's CPU build serves it in bf16), ps-bridge with sharing on against ps-bridge with
sharing off (megatron's stock engine does not build Qwen3.5 on a CPU), 3 steps from one seed, and the
verdict's properties.

Needs the grpo stack (`make grpo-venv`); skipped where vLLM is absent. About 11 minutes on 2 cores (the
format fit of the Qwen3.5 model, then two runs)."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.grpo,
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("vllm", "verl", "torchvision", "fla")),
                       reason="needs the grpo stack (vLLM's CPU build, verl, torchvision, fla: make grpo-venv)"),
]

ROOT = Path(__file__).resolve().parent.parent


def test_qwen35_short_run_passes_the_verdict(tmp_path):
    from ps_bridge.tools.grpo.report import GRAD_NORM, PG_LOSS, PROBS_DIFF_MEAN

    proc = subprocess.run([sys.executable, "-m", "ps_bridge.tools.grpo", "--model", "qwen3.5", "--short",
                           "--out", str(tmp_path), "--no-plot"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    verdict = tmp_path / "qwen3.5" / "verdict.json"
    assert verdict.exists(), f"no verdict (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(verdict.read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert proc.returncode == 0 and result["passed"], f"{failed}\n{proc.stdout[-4000:]}"
    names = {c["name"] for c in result["checks"]}
    for name in ("step 1 rollouts identical", f"{PG_LOSS} equal while rollouts are identical",
                 f"{GRAD_NORM} equal while rollouts are identical", f"{PROBS_DIFF_MEAN} as small as ps-off's",
                 "ps log shows sharing", "ps-off ran ps-bridge's engine with sharing off",
                 "old_log_probs equal per token (the actor's (old) log-probs)",
                 "ref_log_prob equal per token (the reference's log-probs)"):
        assert name in names, name
    # vLLM's log-probs are finite at every step of both runs (they were NaN from the second step on before
    # ps_bridge.compat.main_ppo_on_cpu zeroed the attention blocks of a hybrid model's shared pool)
    from ps_bridge.tools.grpo import report

    for label in ("ps-off", "ps"):
        run = report.load_run(label, tmp_path / "qwen3.5" / label)
        assert run.step_numbers() == [1, 2, 3]
        assert all(math.isfinite(run.value(k, PROBS_DIFF_MEAN)) for k in run.step_numbers())
