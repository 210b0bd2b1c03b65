"""`python -m ps_bridge.tools.grpo`'s orchestration (ps_bridge/tools/grpo/harness.py) with verl's runs
replaced by synthetic ones: which runs it starts with which settings, the exit status of a passing, a
failing and a broken job, and its outputs. The real runs: tests/test_grpo_e2e.py."""

import json
from types import SimpleNamespace

import pytest
from grpo_cases import PS_LOG, TREE_LOG, make_run, twin

from ps_bridge.tools.grpo import harness, report
from ps_bridge.tools.grpo.report import GRAD_NORM, PROBS_DIFF_MEAN


@pytest.fixture
def fake(monkeypatch):
    """Replaces the data build and `launch`; records each run's settings. `state["spoil"]`: labels whose runs
    get a grad norm 1% off; `state["fail"]`: labels whose runs stop."""
    state = {"calls": [], "spoil": set(), "fail": set()}
    built = SimpleNamespace(model="M", max_prompt_tokens=40, system_max_prompt_tokens=120,
                            dir=lambda system=False: "DS" if system else "D")
    monkeypatch.setattr(harness, "build_data", lambda out, seed, say: built)

    def launch(label, engine, model, data_dir, out, steps, seed, max_prompt_length, say, reuse=False, **kw):
        state["calls"].append(dict(label=label, engine=engine, data_dir=data_dir, steps=steps, seed=seed,
                                   max_prompt_length=max_prompt_length, **kw))
        if label in state["fail"]:
            raise harness.RunFailed(label, 1, out / label / "main_ppo.log", "RuntimeError: boom")
        for k in range(1, steps + 1):
            say(f"{engine}: step {k}/{steps} done (1 s)")
        base = make_run("stock", steps=steps)
        log = TREE_LOG if kw.get("tree") else PS_LOG if engine == "ps" else ""
        run = twin(base, label, log)
        if kw.get("resume_from") is not None:
            for k in range(1, harness.RESUME_AFTER + 1):
                del run.steps[k], run.rollouts[k]
        if label in state["spoil"]:
            for v in run.steps.values():
                v[GRAD_NORM] *= 1.01
        return run

    monkeypatch.setattr(harness, "launch", launch)
    return state


def test_full_plan_passes_and_writes_outputs(fake, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert harness.main(["--out", str(tmp_path), "--steps", "5"]) == 0
    calls = {c["label"]: c for c in fake["calls"]}
    assert list(calls) == ["stock", "ps", "ps-resumed", "stock-system", "ps-tree"]
    assert {c["seed"] for c in calls.values()} == {1}
    assert calls["ps"]["save_freq"] == harness.RESUME_AFTER and "save_freq" not in calls["stock"]  # only ps resumes
    assert str(calls["ps-resumed"]["resume_from"]).endswith(f"ps/ckpt/global_step_{harness.RESUME_AFTER}")
    assert calls["ps-tree"]["tree"] and calls["ps-tree"]["data_dir"] == "DS" and calls["stock-system"]["data_dir"] == "DS"
    assert calls["ps-tree"]["max_prompt_length"] == 120 and calls["ps"]["max_prompt_length"] == 40
    assert calls["ps-tree"]["micro_batch"] == calls["stock-system"]["micro_batch"] == harness.TREE_MICRO_BATCH
    assert calls["stock"]["engine"] == "stock" and calls["ps"]["engine"] == "ps"
    out = capsys.readouterr().out
    assert "VERDICT: PASS" in out and "resume from step 3" in out and "system prompt, tree" in out
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert verdict["passed"] and verdict["runs"] == sorted(calls)
    assert (tmp_path / "grpo.png").stat().st_size > 10_000


def test_short_plan_runs_the_pair_only(fake, tmp_path, capsys):
    assert harness.main(["--out", str(tmp_path), "--short", "--no-plot"]) == 0
    assert [c["label"] for c in fake["calls"]] == ["stock", "ps"]
    assert all(c["steps"] == 3 and "save_freq" not in c for c in fake["calls"])
    assert not (tmp_path / "grpo.png").exists()


def test_a_mismatch_exits_1(fake, tmp_path, capsys):
    fake["spoil"].add("ps")
    assert harness.main(["--out", str(tmp_path), "--short", "--no-plot"]) == 1
    out = capsys.readouterr().out
    assert "VERDICT: FAIL" in out and f"[FAIL] {GRAD_NORM} equal while rollouts are identical" in out
    assert not json.loads((tmp_path / "verdict.json").read_text())["passed"]


def test_a_broken_tree_run_exits_2_without_traceback(fake, tmp_path, capsys):
    fake["fail"].add("ps-tree")
    assert harness.main(["--out", str(tmp_path), "--steps", "4", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "the ps-tree run stopped (exit 1): RuntimeError: boom" in err and "Traceback" not in err


def test_noise_floor_runs_when_the_pair_diverges(fake, tmp_path, monkeypatch):
    real = harness.launch

    def diverging(label, *args, **kw):
        run = real(label, *args, **kw)
        if label != "stock":
            for k in (2, 3):
                run.rollouts[k][0] = ("p", f"flip {label}")
        return run

    monkeypatch.setattr(harness, "launch", diverging)
    plan = harness.Plan(out=tmp_path, steps=3)
    checks = harness.run_plan(plan, harness.Progress(harness.planned_steps(plan), verbose=False))
    calls = {c["label"]: c for c in fake["calls"]}
    assert "stock-floor" in calls and calls["stock-floor"]["micro_batch"] == harness.FLOOR_MICRO_BATCH
    assert calls["stock"]["micro_batch"] == harness.MICRO_BATCH != harness.FLOOR_MICRO_BATCH
    assert report.passed(checks), report.format_checks(checks)


def test_resume_needs_steps_past_the_checkpoint(fake, tmp_path):
    with pytest.raises(SystemExit):
        harness.main(["--out", str(tmp_path), "--steps", "3", "--resume"])


def test_stale_weights_fail(fake, tmp_path, monkeypatch, capsys):
    real = harness.launch

    def stale(label, *args, **kw):
        run = real(label, *args, **kw)
        if label == "ps":
            for k in (2, 3):
                run.steps[k][PROBS_DIFF_MEAN] = 1e-3
        return run

    monkeypatch.setattr(harness, "launch", stale)
    assert harness.main(["--out", str(tmp_path), "--short", "--no-plot"]) == 1
    assert f"[FAIL] {PROBS_DIFF_MEAN} as small as stock's" in capsys.readouterr().out


def test_a_failed_run_is_named_by_its_last_error_line(tmp_path):
    log = tmp_path / "main_ppo.log"
    log.write_text(
        "\x1b[36m(WorkerDict pid=1)\x1b[0m AttributeError: module 'x' has no attribute 'y'\n"
        "Error executing job with overrides: ['a=1']\n"
        "Traceback (most recent call last):\n  File \"verl/utils/megatron_utils.py\", line 827\n"
        "AttributeError: 'NoneType' object has no attribute 'storage'\n"
        "\x1b[36m(raylet)\x1b[0m shutting down\n")
    assert harness._last_error(log) == "AttributeError: 'NoneType' object has no attribute 'storage'"
    assert harness._last_error(tmp_path / "absent.log") == "no log written"
