"""Synthetic runs of the grpo job (verl's per-step metrics, rollouts and logs) for the report's and the
harness's tests."""

import json
import random

from ps_bridge.tools.grpo.report import (
    GRAD_NORM, OLD_LOG_PROBS, PG_LOSS, PROBS_DIFF_MAX, PROBS_DIFF_MEAN, REF_LOG_PROBS, REWARD, RunData,
)

PS_LOG = ("(WorkerDict pid=1) [PS][prepare] PATH 6: sharing detected (groups=2, samples=8)\n"
          "(WorkerDict pid=1) [PS][prepare][r0] packed_batch_layout: valid_lengths=[1], groups=2, depth=1, nodes=3\n")
TREE_LOG = PS_LOG.replace("depth=1", "depth=2")
# ps-bridge's engine with PS_BRIDGE_SHARING=off (the Qwen3.5 pair's baseline)
OFF_LOG = ("(WorkerDict pid=1) [PS][prepare][global_rank=0] sharing: unshared: forced off (PS_BRIDGE_SHARING=off)\n"
           "(WorkerDict pid=1) [PS][prepare] PATH 5: no sharing detected (samples=4)\n")


def make_run(label, steps=5, seed=0, n_responses=8, log=""):
    rng = random.Random(seed)
    metrics, rollouts, log_probs = {}, {}, {}
    for k in range(1, steps + 1):
        metrics[k] = {
            REWARD: rng.choice([0.125, 0.25, 0.375]),
            PG_LOSS: rng.uniform(-0.05, 0.05),
            GRAD_NORM: rng.uniform(0.5, 2.0),
            PROBS_DIFF_MEAN: 2e-7,
            PROBS_DIFF_MAX: 3e-6,
            "timing_s/gen": 1.5, "timing_s/update_actor": 2.0, "timing_s/step": 5.0,
        }
        rollouts[k] = [(f"prompt {k}.{i // 4}", f"response {k}.{i} #### {i}") for i in range(n_responses)]
        log_probs[k] = [(p, r, {OLD_LOG_PROBS: [-rng.uniform(0, 5) for _ in range(6)],
                                REF_LOG_PROBS: [-rng.uniform(0, 5) for _ in range(6)]}) for p, r in rollouts[k]]
    return RunData(label, metrics, rollouts, log, log_probs)


def twin(run, label, log="", rel=0.0):
    """A copy of `run` whose pg_loss and grad_norm differ by `rel` relative."""
    steps = {k: dict(v) for k, v in run.steps.items()}
    for v in steps.values():
        v[PG_LOSS] *= 1 + rel
        v[GRAD_NORM] *= 1 + rel
    log_probs = {k: [(p, r, {f: list(x) for f, x in values.items()}) for p, r, values in rows]
                 for k, rows in run.log_probs.items()}
    return RunData(label, steps, {k: list(v) for k, v in run.rollouts.items()}, log, log_probs)


def assert_verdict_passed(verdict_path, proc, base: str):
    """A finished harness run (`proc`, its verdict.json at `verdict_path`) passed, and the properties were
    judged, not skipped; `base`: the baseline's label (stock, or ps-off for Qwen3.5)."""
    assert verdict_path.exists(), f"no verdict (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(verdict_path.read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert proc.returncode == 0 and result["passed"], f"{failed}\n{proc.stdout[-4000:]}"
    names = {c["name"] for c in result["checks"]}
    baseline = "stock ran verl's stock engine" if base == "stock" else f"{base} ran ps-bridge's engine with sharing off"
    for name in ("step 1 rollouts identical", f"{PG_LOSS} equal while rollouts are identical",
                 f"{GRAD_NORM} equal while rollouts are identical", "reward curves match",
                 f"{PROBS_DIFF_MEAN} as small as {base}'s", "ps log shows sharing", baseline,
                 "old_log_probs equal per token (the actor's (old) log-probs)",
                 "ref_log_prob equal per token (the reference's log-probs)"):
        assert name in names, name
    assert "VERDICT: PASS" in proc.stdout and "pg_loss" in proc.stdout
    return result
