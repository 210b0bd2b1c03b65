"""The grpo verdict (ps_bridge/tools/grpo/report.py) on synthetic runs: it passes on equal runs and fails on
each kind of mismatch the main_ppo job must catch."""

import json

import pytest
from grpo_cases import PS_LOG, TREE_LOG, make_run, twin

from ps_bridge.tools.grpo import report
from ps_bridge.tools.grpo.report import (
    GRAD_NORM, LOG_PROB_ATOL, OLD_LOG_PROBS, PG_LOSS, PROBS_DIFF_MAX, PROBS_DIFF_MEAN, REF_LOG_PROBS, REWARD,
)

def failing(checks):
    return [c.name for c in checks if not c.ok]


@pytest.fixture
def stock():
    return make_run("stock")


def test_equal_runs_pass(stock):
    ps = twin(stock, "ps", PS_LOG, rel=3e-6)  # float32 noise
    checks = report.compare_runs(stock, ps) + report.check_logs(stock, ps)
    assert report.passed(checks), report.format_checks(checks)
    assert "VERDICT: PASS" in report.verdict_text(checks)


def test_loss_outside_float32_noise_fails(stock):
    ps = twin(stock, "ps", PS_LOG)
    ps.steps[3][PG_LOSS] = stock.steps[3][PG_LOSS] * (1 + 1e-3) + 1e-5
    bad = failing(report.compare_runs(stock, ps))
    assert bad == [f"{PG_LOSS} equal while rollouts are identical"]


def test_grad_norm_mismatch_fails(stock):
    ps = twin(stock, "ps", PS_LOG)
    ps.steps[5][GRAD_NORM] *= 1.01
    assert failing(report.compare_runs(stock, ps)) == [f"{GRAD_NORM} equal while rollouts are identical"]


def test_step_one_rollouts_differ_fails(stock):
    ps = twin(stock, "ps", PS_LOG)
    ps.rollouts[1][0] = ("prompt 1.0", "another response")
    bad = failing(report.compare_runs(stock, ps))
    assert bad == ["step 1 rollouts identical"]  # nothing after it is judged as exact


def test_missing_rollout_dump_fails(stock):
    ps = twin(stock, "ps", PS_LOG)
    del ps.rollouts[1]
    assert "step 1 rollouts identical" in failing(report.compare_runs(stock, ps))


def test_rollout_order_does_not_matter(stock):
    ps = twin(stock, "ps", PS_LOG)
    ps.rollouts = {k: list(reversed(v)) for k, v in ps.rollouts.items()}
    assert report.passed(report.compare_runs(stock, ps))


def test_stale_weights_in_vllm_fail(stock):
    """What an export that keeps sending the first weights looks like: equal at step 1 (same weights), then
    vLLM's probabilities drift from the actor's."""
    ps = twin(stock, "ps", PS_LOG)
    for k in range(2, 6):
        ps.steps[k][PROBS_DIFF_MEAN] = 1e-3 * k
        ps.steps[k][PROBS_DIFF_MAX] = 2e-2 * k
    bad = failing(report.compare_runs(stock, ps))
    assert bad == [f"{PROBS_DIFF_MEAN} as small as stock's", f"{PROBS_DIFF_MAX} as small as stock's"]


def test_missing_probs_diff_fails(stock):
    ps = twin(stock, "ps", PS_LOG)
    for v in ps.steps.values():
        del v[PROBS_DIFF_MEAN]
    assert f"{PROBS_DIFF_MEAN} as small as stock's" in failing(report.compare_runs(stock, ps))


def test_reward_must_be_equal_with_equal_rollouts(stock):
    ps = twin(stock, "ps", PS_LOG)
    ps.steps[2][REWARD] += 0.125
    assert failing(report.compare_runs(stock, ps)) == ["reward curves match"]


def _flip_from(run, label, step, rel, n_changed=1):
    out = twin(run, label, PS_LOG)
    for k in range(step, max(run.steps) + 1):
        for i in range(n_changed):
            out.rollouts[k][i] = (out.rollouts[k][i][0], f"flipped {k}.{i}")
        out.steps[k][PG_LOSS] += rel
        out.steps[k][GRAD_NORM] += rel
        out.steps[k][REWARD] += 0.125 * n_changed / len(out.rollouts[k])
    return out


def test_flipped_token_within_noise_floor_passes(stock):
    ps = _flip_from(stock, "ps", 3, 0.01)
    floor = _flip_from(stock, "stock-floor", 2, 0.02)
    checks = report.compare_runs(stock, ps, floor)
    assert report.passed(checks), report.format_checks(checks)


def test_flipped_token_beyond_noise_floor_fails(stock):
    ps = _flip_from(stock, "ps", 3, 0.5)
    floor = _flip_from(stock, "stock-floor", 2, 0.02)
    bad = failing(report.compare_runs(stock, ps, floor))
    assert f"{PG_LOSS} after the flip within the noise floor" in bad
    assert f"{GRAD_NORM} after the flip within the noise floor" in bad


def test_flip_without_floor_run_or_floor_flip_is_not_a_pass(stock):
    ps = _flip_from(stock, "ps", 3, 0.01)
    assert not report.passed(report.compare_runs(stock, ps))  # no floor run
    quiet_floor = twin(stock, "stock-floor", rel=1e-7)  # a floor whose rollouts never differ: inconclusive
    checks = report.compare_runs(stock, ps, quiet_floor)
    assert not report.passed(checks)
    assert any("inconclusive" in c.detail for c in checks if not c.ok)


def test_reward_after_flip_bounded_by_differing_responses(stock):
    ps = _flip_from(stock, "ps", 3, 0.0, n_changed=1)
    floor = _flip_from(stock, "stock-floor", 2, 0.0)
    assert "reward curves match" not in failing(report.compare_runs(stock, ps, floor))
    ps.steps[4][REWARD] += 0.5  # more than 1 of 8 responses can move it
    assert "reward curves match" in failing(report.compare_runs(stock, ps, floor))


def test_missing_steps_fail(stock):
    ps = twin(stock, "ps", PS_LOG)
    del ps.steps[5]
    assert "steps" in failing(report.compare_runs(stock, ps))


def test_token_log_probs():
    """Property 8: per token, old log-probs at step 1 and ref log-probs while the rollouts are identical."""
    stock = make_run("stock")
    ps = twin(stock, "ps")
    for rows in ps.log_probs.values():
        for _, _, values in rows:
            values[OLD_LOG_PROBS][0] += 0.5 * LOG_PROB_ATOL  # float32 noise
    ps.log_probs = {k: list(reversed(rows)) for k, rows in ps.log_probs.items()}  # the dump's order is free
    checks = report.compare_log_probs(stock, ps)
    assert report.passed(checks) and len(checks) == 2, report.format_checks(checks)
    assert "steps 1-5" in checks[1].detail and "step 1," in checks[0].detail

    wrong = twin(stock, "ps")
    wrong.log_probs[1][3][2][OLD_LOG_PROBS][4] += 1e-4  # one token of one response
    assert failing(report.compare_log_probs(stock, wrong)) == [f"{OLD_LOG_PROBS} equal per token (the actor's (old) log-probs)"]
    later = twin(stock, "ps")
    later.log_probs[4][0][2][OLD_LOG_PROBS][0] += 1.0  # old log-probs after an update: weights differ by rounding
    later.log_probs[4][0][2][REF_LOG_PROBS][0] += 1e-4  # the reference never changes: judged at every step
    assert failing(report.compare_log_probs(stock, later)) == [f"{REF_LOG_PROBS} equal per token (the reference's log-probs)"]
    flipped = twin(stock, "ps")
    flipped.rollouts[4][0] = flipped.rollouts[4][0][:1] + ("flipped",)
    flipped.log_probs[5][0][2][REF_LOG_PROBS][0] += 1.0  # after the flip: not judged
    assert report.passed(report.compare_log_probs(stock, flipped))
    short = twin(stock, "ps")
    short.log_probs[2][1][2][REF_LOG_PROBS].pop()
    assert not report.passed(report.compare_log_probs(stock, short))  # a response of another length
    undumped = twin(stock, "ps")
    del undumped.log_probs[3]
    bad = report.compare_log_probs(stock, undumped)
    assert not report.passed(bad) and "no log-probs in the rollout dump of ps step 3" in bad[0].detail


def test_logs():
    stock, ps = make_run("stock"), make_run("ps", log=PS_LOG)
    assert report.passed(report.check_logs(stock, ps))
    assert failing(report.check_logs(stock, make_run("ps", log="nothing"))) == ["ps log shows sharing"]
    assert failing(report.check_logs(make_run("stock", log=PS_LOG), ps)) == ["stock ran verl's stock engine"]
    # ps_bridge.verl imported with sharing off (the CPU path borrows its layer spec) is still stock
    off = ("(TaskRunnerV1 pid=2) [PS][prepare] config.enable_prefix_sharing=False tree=False backend=torch_ref "
           "provider=None (ps_bridge.verl)\n")
    assert report.passed(report.check_logs(make_run("stock", log=off), ps))
    on = off.replace("=False tree", "=True tree")
    assert failing(report.check_logs(make_run("stock", log=on), ps)) == ["stock ran verl's stock engine"]
    engine = ("(WorkerDict pid=3) [PS][prepare][global_rank=0] config.enable_prefix_sharing=False sharing=auto "
              "engine=PrefixSharedMegatronEngine model=PrefixSharedGPTModel\n")
    assert failing(report.check_logs(make_run("stock", log=engine), ps)) == ["stock ran verl's stock engine"]
    assert failing(report.check_logs(stock, ps, tree=True)) == ["ps shares the system prompt as a tree"]
    assert report.passed(report.check_logs(stock, make_run("ps", log=TREE_LOG), tree=True))


def test_resume():
    full = make_run("ps")
    resumed = twin(full, "ps-resumed")
    for k in (1, 2, 3):
        del resumed.steps[k], resumed.rollouts[k]
    assert report.passed(report.check_resume(full, resumed, 3))
    resumed.steps[5][GRAD_NORM] *= 1.001
    assert failing(report.check_resume(full, resumed, 3)) == [f"resume from step 3: {GRAD_NORM} equal"]
    resumed = twin(full, "ps-resumed")
    resumed.rollouts[5][0] = ("x", "y")
    assert "resume from step 3: rollouts identical" in failing(report.check_resume(full, resumed, 3))
    # other samples from step 4 on: the resumed weights (or data order) are not the saved ones
    resumed.rollouts[4][0] = ("x", "y")
    assert "resume from step 3: rollouts identical" in failing(report.check_resume(full, resumed, 3))
    del resumed.rollouts[4]
    assert failing(report.check_resume(full, resumed, 3))  # no dump: fails
    del resumed.steps[4]
    assert not report.passed(report.check_resume(full, resumed, 3))


def test_load_run_and_tables(tmp_path):
    run = make_run("stock")
    d = tmp_path / "stock"
    (d / "rollouts").mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for k, v in run.steps.items():
            f.write(json.dumps({"step": k, "data": v}) + "\n")
    for k, rows in run.log_probs.items():
        with open(d / "rollouts" / f"{k}.jsonl", "w") as f:
            for inp, out, values in rows:
                f.write(json.dumps({"input": inp, "output": out, "score": 0.0, "step": k, **values}) + "\n")
    (d / "main_ppo.log").write_text(PS_LOG)
    loaded = report.load_run("stock", d)
    assert loaded.steps == run.steps and loaded.rollouts == run.rollouts and loaded.log == PS_LOG
    assert loaded.log_probs == run.log_probs
    ps = twin(loaded, "ps", PS_LOG, rel=1e-6)
    table = report.metrics_table([loaded, ps])
    lines = table.splitlines()
    assert len(lines) == 2 + 5 and "pg_loss" in lines[0] and lines[2].split()[-1] == "0"
    timing = report.timing_table([loaded, ps])
    assert "update_actor" in timing and "2.00" in timing


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    stock = make_run("stock")
    path = report.plot([("pair", [stock, twin(stock, "ps")]), ("tree", [stock])], tmp_path / "g.png")
    assert path.stat().st_size > 10_000
