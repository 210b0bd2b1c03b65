"""`python -m ps_bridge.tools.grpo`'s orchestration (ps_bridge/tools/grpo/harness.py) with verl's runs
replaced by synthetic ones: which runs it starts with which settings, the exit status of a passing, a
failing and a broken job, and its outputs. The real runs: tests/test_grpo_e2e.py."""

import json
from types import SimpleNamespace

import pytest
from grpo_cases import OFF_LOG, PS_LOG, TREE_LOG, make_run, twin

from ps_bridge.tools.grpo import harness, report
from ps_bridge.tools.grpo.report import GRAD_NORM, PROBS_DIFF_MEAN


@pytest.fixture
def fake(monkeypatch):
    """Replaces the data build and `launch`; records each run's settings. `state["spoil"]`: labels whose runs
    get a grad norm 1% off; `state["fail"]`: labels whose runs stop."""
    state = {"calls": [], "spoil": set(), "fail": set()}
    built = SimpleNamespace(model="M", max_prompt_tokens=40, system_max_prompt_tokens=120,
                            dir=lambda system=False: "DS" if system else "D")
    def build_data(out, seed, say, model="qwen2.5"):
        state["built"] = (out, model)
        return built

    monkeypatch.setattr(harness, "build_data", build_data)
    # the stand-in runs need no vLLM: nothing about this machine's processor is refused
    monkeypatch.setattr(harness, "cpu_hybrid_rollout_refusal", lambda: None)

    def launch(label, engine, model, data_dir, out, steps, seed, max_prompt_length, say, reuse=False, **kw):
        state["calls"].append(dict(label=label, engine=engine, data_dir=data_dir, steps=steps, seed=seed,
                                   max_prompt_length=max_prompt_length, **kw))
        if label in state["fail"]:
            raise harness.RunFailed(label, 1, out / label / "main_ppo.log", "RuntimeError: boom")
        for k in range(1, steps + 1):
            say(f"{engine}: step {k}/{steps} done (1 s)")
        base = make_run("stock", steps=steps)
        log = (TREE_LOG if kw.get("tree") else OFF_LOG if kw.get("sharing") is False else PS_LOG) if engine == "ps" else ""
        log = state.get("logs", {}).get(label, log)
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


def test_qwen35_pairs_sharing_on_with_sharing_off(fake, tmp_path, capsys):
    """megatron's stock engine does not build Qwen3.5 on a CPU: the baseline is ps-bridge's engine with sharing
    off, and its log must show sharing forced off."""
    assert harness.main(["--out", str(tmp_path), "--short", "--no-plot", "--model", "qwen3.5"]) == 0
    calls = {c["label"]: c for c in fake["calls"]}
    assert list(calls) == ["ps-off", "ps"]
    assert calls["ps-off"]["engine"] == "ps" and calls["ps-off"]["sharing"] is False
    assert calls["ps"]["engine"] == "ps" and "sharing" not in calls["ps"]
    assert fake["built"] == (tmp_path / "qwen3.5", "qwen3.5")
    out = capsys.readouterr().out
    assert "VERDICT: PASS" in out and "ps-off ran ps-bridge's engine with sharing off" in out
    assert json.loads((tmp_path / "qwen3.5" / "verdict.json").read_text())["runs"] == ["ps", "ps-off"]


def test_qwen35_baseline_that_shared_fails(fake, tmp_path, capsys):
    fake["logs"] = {"ps-off": PS_LOG}
    assert harness.main(["--out", str(tmp_path), "--short", "--no-plot", "--model", "qwen3.5"]) == 1
    assert "[FAIL] ps-off ran ps-bridge's engine with sharing off" in capsys.readouterr().out


def test_launch_settings_follow_the_model_and_sharing(tmp_path):
    """A Gated DeltaNet checkpoint gets vLLM's bf16 rollout with a float32 recurrent state on a CPU (vLLM's CPU
    Gated DeltaNet runs in bf16 only); PS_BRIDGE_SHARING=off only for a ps run with sharing off."""
    from ps_bridge.tools.grpo.launch import RunSpec, build_command

    dense, hybrid = tmp_path / "dense", tmp_path / "hybrid"
    dense.mkdir(), hybrid.mkdir()
    (dense / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    (hybrid / "config.json").write_text(json.dumps(
        {"text_config": {"layer_types": ["linear_attention", "full_attention"]}}))

    def settings(model, **kw):
        argv, env = build_command(RunSpec(engine="ps", model_dir=model, data_dir=tmp_path, out_dir=tmp_path, **kw),
                                  on_cpu=True)
        return [a for a in argv if "rollout.dtype" in a or "mamba_ssm" in a], env

    args, env = settings(dense)
    assert args == ["actor_rollout_ref.rollout.dtype=float32"] and "PS_BRIDGE_SHARING" not in env
    args, env = settings(hybrid, sharing=False)
    assert args == ["actor_rollout_ref.rollout.dtype=bfloat16",
                    "+actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_ssm_cache_dtype=float32"]
    assert env["PS_BRIDGE_SHARING"] == "off" and env["ENABLE_PREFIX_SHARING"] == "1"
    with pytest.raises(ValueError, match="sharing=False needs engine='ps'"):
        RunSpec(engine="stock", model_dir=dense, data_dir=tmp_path, out_dir=tmp_path, sharing=False)


def test_a_mismatch_exits_1(fake, tmp_path, capsys):
    fake["spoil"].add("ps")
    assert harness.main(["--out", str(tmp_path), "--short", "--no-plot"]) == 1
    out = capsys.readouterr().out
    assert "VERDICT: FAIL" in out and f"[FAIL] {GRAD_NORM} equal while rollouts are identical" in out
    assert not json.loads((tmp_path / "verdict.json").read_text())["passed"]


@pytest.mark.parametrize("right, system_right, stops", [(20, 20, False), (4, 20, True), (20, 7, True)])
def test_a_fit_with_too_few_right_answers_stops_before_the_runs(monkeypatch, tmp_path, capsys, right,
                                                                system_right, stops):
    """Data whose model is rarely right would give all-0 advantages: the job names the fit and stops."""
    from ps_bridge.tools.grpo import data

    fit = data.FitSummary(300, 0.2, 64, 64, right, 64, 64, system_right)
    built = SimpleNamespace(model="M", max_prompt_tokens=40, vocab_size=640, tokenizer_size=531, fit=fit)
    monkeypatch.setattr(data, "build", lambda out, seed, model, progress: built)
    if stops:
        with pytest.raises(harness.WeakFit, match=f"right on {right}/64 sampled answers .{system_right}/64"):
            harness.build_data(tmp_path, 1, say=lambda line: None)
        launched = []
        monkeypatch.setattr(harness, "launch", lambda *a, **kw: launched.append(a))
        assert harness.main(["--out", str(tmp_path), "--short", "--no-plot"]) == 2
        assert not launched and "--seed" in capsys.readouterr().err
    else:
        assert harness.build_data(tmp_path, 1, say=lambda line: None) is built


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


def test_tree_noise_floor_runs_when_the_tree_pair_diverges(fake, tmp_path, monkeypatch):
    real = harness.launch

    def diverging(label, *args, **kw):
        run = real(label, *args, **kw)
        if label in ("ps-tree", "stock-system-floor"):
            for k in (2, 3):
                run.rollouts[k][0] = ("p", f"flip {label}")
        return run

    monkeypatch.setattr(harness, "launch", diverging)
    plan = harness.Plan(out=tmp_path, steps=3, tree=True)
    checks = harness.run_plan(plan, harness.Progress(harness.planned_steps(plan), verbose=False))
    calls = {c["label"]: c for c in fake["calls"]}
    assert "stock-floor" not in calls  # the plain pair's rollouts stayed identical
    floor = calls["stock-system-floor"]
    assert floor["engine"] == "stock" and floor["data_dir"] == "DS" and "tree" not in floor
    assert floor["micro_batch"] == harness.TREE_FLOOR_MICRO_BATCH != harness.TREE_MICRO_BATCH
    assert report.passed(checks), report.format_checks(checks)
    assert any(c.name.startswith("system prompt, tree: noise floor:") for c in checks)


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


def test_rollout_dump_carries_each_responses_log_probs():
    """logprob_dump hands verl's dump the TransferQueue's per-response log-probs in the dump's (sorted) order,
    and leaves the trainer's own dump method in place afterwards."""
    import torch

    from ps_bridge.tools.grpo import logprob_dump

    keys = ["b_0_1", "a_0_0", "b_0_0"]
    rows = {k: [float(i), float(i) + 0.5] if i != 1 else [1.0] for i, k in enumerate(keys)}
    written = {}

    class TQ:
        @staticmethod
        def kv_batch_get(keys, partition_id, select_fields):
            assert partition_id == "train_0" and set(select_fields) == set(logprob_dump.FIELDS)
            nested = torch.nested.nested_tensor([torch.tensor(rows[k]) for k in keys], layout=torch.jagged)
            return {f: nested for f in select_fields}

    class PPOTrainer:  # verl's: dumps in uid order
        def _dump_generations(self, inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path):
            written.update(reward_extra_infos_dict)

        def _log_rollout_data(self, batch, timing_raw, rollout_data_dir):
            order = sorted(batch.keys)
            self._dump_generations([""] * 3, [""] * 3, [None] * 3, [0.0] * 3, {"uid": order}, rollout_data_dir)

    module = SimpleNamespace(PPOTrainer=PPOTrainer, tq=TQ)
    logprob_dump._with_log_probs(module)
    logprob_dump._with_log_probs(module)  # installed once
    trainer = PPOTrainer()
    trainer._log_rollout_data(SimpleNamespace(keys=keys, partition_id="train_0"), {}, "dir")
    assert written["uid"] == ["a_0_0", "b_0_0", "b_0_1"]
    for field in logprob_dump.FIELDS:
        assert written[field] == [rows["a_0_0"], rows["b_0_0"], rows["b_0_1"]]
    assert "_dump_generations" not in vars(trainer)


def test_qwen35_on_a_cpu_with_amx_tiles_is_refused_up_front(monkeypatch, tmp_path, capsys):
    """vLLM's CPU build cannot serve Qwen3.5 to verl on a processor with AMX tiles: the harness says so
    before it starts anything; without AMX tiles, or with an accelerator, nothing is refused."""
    import torch
    from ps_bridge.tools.grpo import launch

    monkeypatch.setattr(launch, "has_accelerator", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    refusal = launch.cpu_hybrid_rollout_refusal()
    assert refusal and "AMX tiles" in refusal and "--model qwen2.5 runs here" in refusal
    monkeypatch.setattr(harness, "run_plan", lambda *a: pytest.fail("the run started"))
    assert harness.main(["--model", "qwen3.5", "--out", str(tmp_path), "--short", "--no-plot"]) == 2
    assert "error: vLLM's CPU build" in capsys.readouterr().err
    monkeypatch.setattr(launch, "has_accelerator", lambda: True)
    assert launch.cpu_hybrid_rollout_refusal() is None
    monkeypatch.setattr(launch, "has_accelerator", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert launch.cpu_hybrid_rollout_refusal() is None
