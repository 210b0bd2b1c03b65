"""`ps-bridge verl-check --smoke` (verl's trainer step, stock vs prefix-shared engine, fp32, CPU) and the
prefix-aware micro-batching it relies on: token budgets counted in packed tokens, groups whole,
groups kept on one data-parallel rank."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

import ps_bridge.verl.side_by_side as vt  # noqa: E402

vt.prepare_side_by_side()

from ps_bridge.verl import check  # noqa: E402
from ps_bridge.verl.engine import group_dp_partitions, packed_units, partition_units  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.core
def test_verl_check_smoke(tmp_path):
    """The CI run: every step's old/ref log-probs within 1e-5, every optimizer step's loss and grad
    norm within 1e-5 relative, no more micro-batches than the stock engine."""
    out = tmp_path / "out.json"
    plot = tmp_path / "out.png"
    args = [sys.executable, "-m", "ps_bridge.cli", "verl-check", "--smoke", "--no-progress", "--json", str(out),
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


def test_check_failures_catches_a_difference():
    doc = {"steps": [{"step": 1, "logprob_max_abs_diff": 2e-5, "ref_logprob_max_abs_diff": 0.0,
                      "updates": [{"loss": {"stock": 1.0, "shared": 1.001}, "grad_norm": {"stock": 2.0, "shared": 2.0}}],
                      "micro_batches": {"stock": 3, "shared": 4}}]}
    bad = check.check_failures(doc)
    assert len(bad) == 3, bad


def test_ideal_ratio_of_varied_lengths():
    s = check.CheckSettings(model="x", n=2, prompt_len=10)
    # groups [3, 5] and [1, 1]: unshared 13 + 15 + 11 + 11 = 50, shared (10 + 8) + (10 + 2) = 30
    assert check.ideal_ratio(s, [3, 5, 1, 1]) == pytest.approx(50 / 30)


def test_trainer_config_overrides_reach_the_actor_config():
    s = check.CheckSettings(model="x", n=4, overrides=["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=777",
                                                       "actor_rollout_ref.actor.kl_loss_coef=0.5"])
    actor, ref, rollout = check.role_configs(check.trainer_config(s))
    assert actor.ppo_max_token_len_per_gpu == 777 and actor.kl_loss_coef == 0.5 and actor.use_dynamic_bsz
    assert type(actor.optim).__name__ == "McoreOptimizerConfig"
    assert ref.ppo_max_token_len_per_gpu == 32768 and rollout["max_token_len"] == 32768
    with pytest.raises(ValueError, match="bad verl setting"):  # a typo is refused, not ignored
        check.trainer_config(check.CheckSettings(model="x", overrides=["actor_rollout_ref.actor.ppo_max_token_len=1"]))


# ---- prefix-aware micro-batches ----------------------------------------------------------------------

def _batch(P=100, lengths=((10, 20, 30, 40), (50, 5, 5, 5), (80, 80, 80, 80))):
    groups, prompt, total, i = [], [], [], 0
    for g in lengths:
        groups.append(list(range(i, i + len(g))))
        for r in g:
            prompt.append(P)
            total.append(P + r)
            i += 1
    return groups, prompt, total


def test_packed_units_count_each_prompt_once():
    groups, prompt, total = _batch()
    units = packed_units(groups, prompt, total, budget=10_000)
    assert [t for _, t in units] == [200, 165, 420]
    assert [u for u, _ in units] == groups
    # padded to a multiple of 8: the prompt and every response segment
    assert packed_units(groups[:1], prompt, total, 10_000, pad_multiple=8)[0][1] == 104 + 16 + 24 + 32 + 40


def test_a_group_over_the_budget_is_cut_into_parts_that_fit():
    groups, prompt, total = _batch()
    units = packed_units(groups, prompt, total, budget=300)
    assert [t for _, t in units] == [200, 165, 260, 260]  # the third group in two parts, each with its prompt
    assert sorted(i for u, _ in units for i in u) == list(range(12))
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        packed_units(groups, prompt, total, budget=150)


def test_partition_keeps_units_whole_within_the_budget_and_balanced():
    tokens = [200, 165, 420, 90, 310, 120]
    parts = partition_units(tokens, budget=450)
    assert sorted(u for p in parts for u in p) == list(range(len(tokens)))
    loads = [sum(tokens[u] for u in p) for p in parts]
    assert max(loads) <= 450
    assert len(parts) == 4  # sum 1305 needs 3 at least; 420 + anything but 90 overflows
    # the unshared count of the same samples would need far more: each response carries its prompt
    assert max(loads) - min(loads) <= 200


def test_fewer_micro_batches_than_verl_counts_unshared():
    groups, prompt, total = _batch(P=1000, lengths=[[100] * 8] * 4)
    budget = 4096
    unshared = -(-sum(total) // budget)  # verl's lower bound on its count: 32 x 1100 tokens
    shared = len(partition_units([t for _, t in packed_units(groups, prompt, total, budget)], budget))
    assert shared == 2 and unshared == 9  # 4 groups of 1000 + 8 x 100 packed tokens


def test_group_dp_partitions_keep_groups_on_one_rank():
    uids = [f"g{i // 4}" for i in range(24)]
    uids = uids[::2] + uids[1::2]  # members need not be adjacent
    prompt = [64] * 24
    total = [64 + 8 * (i % 7 + 1) for i in range(24)]
    parts = group_dp_partitions(uids, prompt, total, dp_size=3)
    assert sorted(i for p in parts for i in p) == list(range(24))
    for p in parts:
        assert len(p) == 8  # 6 groups of 4 over 3 ranks, equal group counts
        for i in p:
            assert all(j in p for j in range(24) if uids[j] == uids[i])
    with pytest.raises(ValueError, match="groups"):
        group_dp_partitions(uids[:2], prompt[:2], total[:2], dp_size=2)  # one group, two ranks
