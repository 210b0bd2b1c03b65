"""The short form of `make grpo`: verl's own `main_ppo` (GRPO, Megatron actor and ref, vLLM rollout, Ray on
this machine) with verl's stock engine and with ps-bridge, 3 steps from one seed, and the verdict's
properties; then the same ps-bridge run with its weight export frozen at the first export (tests/
grpo_stale_export.py), which the verdict must fail.

Needs the grpo stack (`make grpo-venv`, .venv-grpo: vLLM's CPU build); skipped where vLLM is absent, so the
newest and oldest stacks' suites skip it. Several minutes on 2 cores."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_cases import assert_verdict_passed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.grpo,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("verl") is None,
                       reason="needs the grpo stack (vLLM's CPU build and verl: make grpo-venv)"),
]

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
STEPS = 3
SEED = 1  # the harness's default --seed


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    proc = subprocess.run([sys.executable, "-m", "ps_bridge.tools.grpo", "--short", "--steps", str(STEPS),
                           "--out", str(out), "--seed", str(SEED), "--no-plot"], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    return out, proc


def test_short_run_passes_the_verdict(short_run):
    out, proc = short_run
    assert_verdict_passed(out / "verdict.json", proc, "stock")


def test_training_moved_the_weights(short_run):
    """The stale-weights case below can only fail if training changes the weights: rewards vary inside a
    group (so GRPO's advantages are not all 0) and the grad norm is not 0."""
    from ps_bridge.tools.grpo import report

    out, _ = short_run
    stock = report.load_run("stock", out / "stock")
    assert any(stock.value(k, report.GRAD_NORM) > 1e-3 for k in stock.step_numbers())
    assert any(0 < stock.value(k, report.REWARD) < 1 for k in stock.step_numbers())


def test_stale_weights_in_vllm_fail_the_verdict(short_run, monkeypatch):
    from ps_bridge.tools.grpo import harness, report

    out, _ = short_run
    stock = report.load_run("stock", out / "stock")
    built = harness.build_data(out, SEED, say=lambda line: None)  # reads back the files the short run wrote
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    stale = harness.launch(
        "ps-stale", "ps", built.model, built.data_dir, out, STEPS, seed=SEED, micro_batch=harness.MICRO_BATCH,
        max_prompt_length=built.max_prompt_tokens, say=lambda line: None,
        extra_overrides=("actor_rollout_ref.model.external_lib=grpo_stale_export",))
    assert "[grpo_stale_export] weight export frozen" in stale.log  # the patch ran in the workers
    checks = report.compare_runs(stock, stale)
    failed = {c.name for c in checks if not c.ok}
    assert not report.passed(checks)
    assert f"{report.PROBS_DIFF_MEAN} as small as stock's" in failed, report.format_checks(checks)
