"""`ps-bridge verl-check --smoke` (verl's trainer step, stock vs prefix-shared engine, fp32, CPU), its
settings and its checks. The prefix-aware micro-batching it relies on: tests/test_verl_micro_batches.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

import ps_bridge.tools.verl_check.side_by_side as vt  # noqa: E402

vt.prepare_side_by_side()

from ps_bridge.tools import verl_check as check  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.core
def test_verl_check_smoke(tmp_path):
    """The CI run: every step's old/ref log-probs within 1e-5, every optimizer step's loss and grad
    norm within 1e-5 relative, no more micro-batches than the stock engine."""
    out = tmp_path / "out.json"
    plot = tmp_path / "out.png"
    args = [sys.executable, "-m", "ps_bridge.tools.cli", "verl-check", "--smoke", "--no-progress", "--json", str(out),
            "--workdir", str(tmp_path)]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plot", str(plot)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert len(doc["steps"]) == 3
    assert check.check_failures(doc) == []
    rel = lambda a, b: abs(a - b) / max(abs(a), abs(b), 1e-12)  # noqa: E731
    for s in doc["steps"]:
        assert set(s) >= {"step", "logprob_max_abs_diff", "ref_logprob_max_abs_diff", "entropy_max_abs_diff", "loss",
                          "grad_norm", "updates", "kl", "phase_seconds", "micro_batches", "peak_memory_gib"}
        assert s["logprob_max_abs_diff"] <= 1e-5 and s["ref_logprob_max_abs_diff"] <= 1e-5
        assert len(s["updates"]) == 2  # 4 prompts, mini-batches of 2
        for u in s["updates"]:
            assert rel(u["loss"]["stock"], u["loss"]["shared"]) <= 1e-5
            assert rel(u["grad_norm"]["stock"], u["grad_norm"]["shared"]) <= 1e-5
        assert s["micro_batches"]["shared"] < s["micro_batches"]["stock"]  # the packed budget holds more
        assert set(s["phase_seconds"]["shared"]) == set(check.PHASES)
    assert doc["config"]["ideal_speedup_S"] > 1
    assert "reference" in doc["config"]["stock_engine"]
    # F: every micro-batch the shared engine packed was counted once per phase (each phase covers the
    # step's samples: the same unshared FLOPs in all three), sharing computed fewer
    F = doc["config"]["flop_ratio_F"]
    assert set(F) == set(check.PHASES) and all(f > 1 for f in F.values())
    for s in doc["steps"]:
        counts = s["flops"]["shared"]
        assert s["flops"]["stock"] is None
        assert counts["update"]["unshared"] == pytest.approx(counts["old_log_prob"]["unshared"], rel=1e-12)
        assert counts["ref"]["unshared"] == pytest.approx(counts["old_log_prob"]["unshared"], rel=1e-12)
    assert " F)" in proc.stdout or " F," in proc.stdout


def test_check_failures_catches_a_difference():
    doc = {"steps": [{"step": 1, "logprob_max_abs_diff": 2e-5, "ref_logprob_max_abs_diff": 0.0,
                      "updates": [{"loss": {"stock": 1.0, "shared": 1.001}, "grad_norm": {"stock": 2.0, "shared": 2.0}}],
                      "micro_batches": {"stock": 3, "shared": 4}}]}
    bad = check.check_failures(doc)
    assert len(bad) == 3, bad


def test_speedups_of_sums_and_of_medians():
    """The sum counts a one-off slow step; the median does not; the first step never counts."""
    def step(stock, shared):
        return {"phase_seconds": {"stock": {ph: stock for ph in check.PHASES},
                                  "shared": {ph: shared for ph in check.PHASES}}}

    steps = [step(9.0, 1.0), step(1.0, 0.5), step(1.0, 0.5), step(1.0, 4.0)]
    assert check.speedups(steps)["update"] == pytest.approx(3.0 / 5.0)
    assert check.speedups(steps, statistic="median")["update"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="statistic"):
        check.speedups(steps, statistic="mean")


def test_ideal_ratio_of_varied_lengths():
    s = check.CheckSettings(model="x", n=2, prompt_len=10)
    # groups [3, 5] and [1, 1]: unshared 13 + 15 + 11 + 11 = 50, shared (10 + 8) + (10 + 2) = 30
    assert check.ideal_ratio(s, [3, 5, 1, 1]) == pytest.approx(50 / 30)


def test_ideal_ratio_with_a_system_prompt():
    s = check.CheckSettings(model="x", prompts=2, n=2, prompt_len=10, system_prompt_len=6)
    # one step, groups [3, 5] and [1, 1]: unshared 6 x 4 + 50, shared 6 once + (10 + 8) + (10 + 2)
    assert check.ideal_ratio(s, [3, 5, 1, 1]) == pytest.approx(74 / 36)
    # two steps: the system prompt once per step
    assert check.ideal_ratio(s, [3, 5, 1, 1] * 2) == pytest.approx(148 / 72)


@pytest.mark.slow
def test_verl_check_smoke_with_a_system_prompt(tmp_path):
    """`--system-prompt-len`: every prompt begins with the same 16 tokens and the shared engine runs on
    prefix trees (threshold 0, `PS_BRIDGE_TREE_MIN_SHARED=0`: 16 tokens are below the default); exact
    against the stock engine, fewer micro-batches. `--interleave` (both engines resident, steps in
    turns) changes no result."""
    out = tmp_path / "out.json"
    args = [sys.executable, "-m", "ps_bridge.tools.cli", "verl-check", "--smoke", "--system-prompt-len", "16", "--no-progress",
            "--interleave", "--json", str(out), "--workdir", str(tmp_path)]
    env = dict(os.environ, PS_BRIDGE_TREE_MIN_SHARED="0")
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert check.check_failures(doc) == []
    assert doc["config"]["system_prompt_len"] == 16 and doc["config"]["tree"]
    assert doc["config"]["engine_order"] == ["stock", "shared", "interleaved"]
    assert "system prompt 16 + P=24" in proc.stdout and "prefix trees" in proc.stdout
    for s in doc["steps"]:
        assert s["micro_batches"]["shared"] < s["micro_batches"]["stock"]


def test_interleaved_engines_take_turns_and_are_freed(monkeypatch):
    """`--interleave`: steps A B, B A, A B, ...; each kind's records in its step order; every
    engine's generator closed (engines freed) also when a step fails."""
    from ps_bridge.tools.verl_check import run as run_mod

    calls, closed = [], []

    def fake_steps(kind, settings, ckpt, cfg, batches, progress):
        try:
            for t, _ in enumerate(batches):
                if kind == "shared" and t == 3:
                    raise RuntimeError("boom")
                calls.append((kind, t))
                yield {"kind": kind, "step": t}
        finally:
            closed.append(kind)

    monkeypatch.setattr(run_mod, "kind_steps", fake_steps)
    runs = run_mod.run_interleaved(("stock", "shared"), None, None, None, [0, 1, 2], print)
    assert calls == [("stock", 0), ("shared", 0), ("shared", 1), ("stock", 1), ("stock", 2), ("shared", 2)]
    assert [r["step"] for r in runs["shared"]] == [0, 1, 2] and sorted(closed) == ["shared", "stock"]
    closed.clear()
    with pytest.raises(RuntimeError, match="boom"):
        run_mod.run_interleaved(("stock", "shared"), None, None, None, [0, 1, 2, 3], print)
    assert sorted(closed) == ["shared", "stock"]


def test_trainer_config_overrides_reach_the_actor_config():
    s = check.CheckSettings(model="x", n=4, overrides=["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=777",
                                                       "actor_rollout_ref.actor.kl_loss_coef=0.5"])
    actor, ref, rollout = check.role_configs(check.trainer_config(s))
    assert actor.ppo_max_token_len_per_gpu == 777 and actor.kl_loss_coef == 0.5 and actor.use_dynamic_bsz
    assert type(actor.optim).__name__ == "McoreOptimizerConfig"
    assert ref.ppo_max_token_len_per_gpu == 32768 and rollout["max_token_len"] == 32768
    with pytest.raises(ValueError, match="bad verl setting"):  # a typo is refused, not ignored
        check.trainer_config(check.CheckSettings(model="x", overrides=["actor_rollout_ref.actor.ppo_max_token_len=1"]))


def test_counting_compiles_sees_triton_hooks_and_restores_them():
    """verl-check's per-phase compile count: the hooks it installs count each compile (start to end)
    and chain to hooks already installed; on exit Triton's own hooks are back. The report lists
    compiles in timed steps only."""
    triton = pytest.importorskip("triton")
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no JIT hooks")
    from ps_bridge.tools.verl_check.compiles import counting_compiles
    from ps_bridge.tools.verl_check.report import compile_lines

    seen = []
    runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        fn = type("Fn", (), {"name": "causal_conv1d_fwd_kernel"})()
        with counting_compiles() as rec:
            for _ in range(2):
                runtime.jit_cache_hook(fn=fn, key=None)
                runtime.jit_post_compile_hook(fn=fn, key=None)
        assert rec["count"] == 2 and rec["kernels"] == ["causal_conv1d_fwd_kernel"] * 2 and rec["seconds"] >= 0
        assert seen == ["causal_conv1d_fwd_kernel"] * 2  # the earlier hook still called
        assert runtime.jit_cache_hook is None and runtime.jit_post_compile_hook is not None
        with counting_compiles() as none:
            pass
        assert none["count"] == 0
    finally:
        runtime.jit_post_compile_hook = None
    steps = [{"step": t, "compiles": {"stock": {"update": rec if t == 1 else none}, "shared": {"update": rec}}}
             for t in (1, 2)]
    lines = compile_lines(steps, ("stock", "shared"))
    assert lines[0].startswith("Triton compiles") and len(lines) == 2 and "step 2 shared update: 2" in lines[1]


def test_the_report_counts_cuda_graphs_per_engine_and_phase():
    from ps_bridge.tools.verl_check.report import graph_lines

    none = {"captures": 0, "replays": 0}
    steps = [{"step": 1, "cuda_graphs": {"stock": {"update": none}, "shared": {"update": {"captures": 2, "replays": 1},
                                                                          "old_log_prob": none}}},
             {"step": 2, "cuda_graphs": {"stock": {"update": none}, "shared": {"update": {"captures": 0, "replays": 4},
                                                                          "old_log_prob": none}}}]
    assert graph_lines(steps, ("stock", "shared")) == ["CUDA graphs, shared engine: update 2 captured / 5 replayed"]
    steps[1]["cuda_graphs"]["shared"]["ref"] = {"captures": 0, "replays": 0, "no_room": 1}
    assert graph_lines(steps, ("stock", "shared")) == [
        "CUDA graphs, shared engine: update 2 captured / 5 replayed, ref 0 captured / 0 replayed / 1 left eager "
        "(PS_BRIDGE_CUDA_GRAPH_MEMORY)"]
    assert graph_lines([{"step": 1}], ("stock", "shared")) == []  # runs without graphs print nothing


def test_verl_check_settings_carry_the_tree_option(monkeypatch):
    from ps_bridge.tools.verl_check.config import CheckSettings
    from ps_bridge.tools.verl_check.roles import shared_tree

    monkeypatch.delenv("PS_BRIDGE_TREE", raising=False)
    assert shared_tree(CheckSettings(model="m")) is True
    assert shared_tree(CheckSettings(model="m", tree=False)) is False
    monkeypatch.setenv("PS_BRIDGE_TREE", "0")
    assert shared_tree(CheckSettings(model="m")) is False
