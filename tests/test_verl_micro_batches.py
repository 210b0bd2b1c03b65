"""The prefix-aware micro-batching of the verl engine (`ps_bridge.verl.micro_batches`), on the host:
units are subtrees of the layout's tree that fit the budget with the path above them, first-fit
decreasing keeps the parts below one prefix in the micro-batch that already holds it, and every
micro-batch's own layout fits the budget. The engine runs of the same batches (against verl's stock
engine) are in tests/test_verl_engine.py."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

import ps_bridge.tools.verl_check.side_by_side as vt  # noqa: E402

vt.prepare_side_by_side()

from verl.utils import tensordict_utils as tu  # noqa: E402

from ps_bridge.layout import Sample, build_layout  # noqa: E402
from ps_bridge.plan import SharingPlan  # noqa: E402
from ps_bridge.tools.tiny_checkpoints import system_prompt_samples  # noqa: E402
from ps_bridge.verl.micro_batches import (  # noqa: E402
    bin_tokens, first_fit_decreasing, group_dp_partitions, split_to_count, subtree_units,
)
from tree_cases import tree_samples  # noqa: E402


def micro_batches(samples, budget, share, pad=1, min_shared=0):
    """Sample indices per micro-batch (first-fit decreasing, before the count is agreed)."""
    layout = build_layout(samples, share=share, pad_multiple=pad, min_shared=min_shared)
    units, cost = subtree_units(layout, budget)
    bins = first_fit_decreasing(units, cost, budget)
    return [sorted(i for u in b for i in units[u].samples) for b in bins], units, cost, bins


def own_tokens(samples, share, pad=1, min_shared=0):
    """What a micro-batch of `samples` packs: its own layout's padded segments."""
    return sum(build_layout(samples, share=share, pad_multiple=pad, min_shared=min_shared).host["padded_lengths"])


@pytest.mark.core
def test_one_level_units_are_groups_with_each_prompt_once():
    rng = random.Random(0)
    samples = []
    for g in [(10, 20, 30, 40), (50, 5, 5, 5), (80, 80, 80, 80)]:  # groups of prompt 100
        prompt = [rng.randrange(1000) for _ in range(100)]
        samples += [Sample(prompt, [1] * r) for r in g]
    layout = build_layout(samples, share=True)
    units, cost = subtree_units(layout, budget=10_000)
    assert sorted(bin_tokens(units, [u], cost) for u in range(len(units))) == [165, 200, 420]
    # a group over the budget: its responses become units, each carrying the prompt
    parts, units, cost, bins = micro_batches(samples, budget=300, share=True)
    assert sorted(i for p in parts for i in p) == list(range(12))
    assert all(bin_tokens(units, b, cost) <= 300 for b in bins)
    assert len(parts) == 4  # 1305 packed tokens when the third group's prompt is counted twice
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):  # a sample of 180 tokens over 150
        micro_batches(samples, budget=150, share=True)


@pytest.mark.core
def test_tree_keeps_a_system_prompt_once_per_micro_batch_and_needs_fewer():
    samples = system_prompt_samples(1000, system_len=40, num_prompts=4, n=4, prompt_len=(10, 10), response_len=(4, 12))
    lengths = [len(s.prompt) + len(s.response) for s in samples]
    budget = 2 * max(lengths)
    tree, units, cost, bins = micro_batches(samples, budget, share="tree")
    one_level, *_ = micro_batches(samples, budget, share=True)
    unshared = -(-sum(lengths) // budget)  # verl's lower bound
    assert sorted(i for p in tree for i in p) == list(range(len(samples)))
    assert len(tree) < len(one_level) <= unshared, (len(tree), len(one_level), unshared)
    for part, b in zip(tree, bins):  # the count is the micro-batch's own layout, within the budget
        assert own_tokens([samples[i] for i in part], "tree") <= bin_tokens(units, b, cost) <= budget
    for p in range(4):  # the groups stay whole
        assert sum(any(samples[i].uid == f"p{p}" for i in part) for part in tree) == 1


@pytest.mark.core
@pytest.mark.parametrize("seed", range(12))
def test_random_trees_every_micro_batch_fits(seed):
    samples = tree_samples(seed, vocab=8, max_samples=24)
    longest = max(len(s.prompt) + len(s.response) for s in samples)
    for pad in (1, 4):
        budget = -(-longest // pad) * pad + seed % 3 * 7
        parts, units, cost, bins = micro_batches(samples, budget, share="tree", pad=pad)
        assert sorted(i for p in parts for i in p) == list(range(len(samples)))
        for part, b in zip(parts, bins):
            assert own_tokens([samples[i] for i in part], "tree", pad) <= bin_tokens(units, b, cost) <= budget
        # more micro-batches than verl's lower bound would be: never more than one per sample
        k = len(samples)
        split = split_to_count(units, bins, k, cost)
        assert len(split) == k and sorted(i for b in split for u in b for i in units[u].samples) == list(range(k))
        assert all(bin_tokens(units, b, cost) <= budget for b in split)


@pytest.mark.core
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


@pytest.mark.core
def test_prefix_aware_micro_batches_on_a_verl_batch():
    """verl's `prepare_micro_batches` contract on a batch our engine marked: every sample once, the
    count raised to verl's minimum by splitting, an impossible count refused."""
    from ps_bridge.verl.micro_batches import PLAN_KEY, mark_plan, prefix_aware_micro_batches

    samples = system_prompt_samples(256, system_len=20, num_prompts=3, n=3)
    budget = 2 * max(len(s.prompt) + len(s.response) for s in samples)
    td = vt.grpo_micro_batch(samples, max_token_len=budget)
    mark_plan(td, SharingPlan("tree", min_shared=0, pad_multiple=1))
    batches, indices = prefix_aware_micro_batches(td)
    expected, *_ = micro_batches(samples, budget, share="tree")
    assert sorted(map(sorted, indices)) == sorted(expected)
    assert [len(b) for b in batches] == [len(i) for i in indices]
    # each micro-batch carries the settings to the forward step; a part of the batch, no tree
    plans = [tu.get_non_tensor_data(b, key=PLAN_KEY, default=None) for b in batches]
    assert all(p == SharingPlan("tree", min_shared=0, pad_multiple=1) and p.tree is None for p in plans)
    # the whole batch in one micro-batch: the batch's plan, its tree decided once and carried along
    whole = vt.grpo_micro_batch(samples, max_token_len=sum(len(s.prompt) + len(s.response) for s in samples))
    mark_plan(whole, SharingPlan("tree", min_shared=0, pad_multiple=1))
    [one], [idx] = prefix_aware_micro_batches(whole)
    plan = tu.get_non_tensor_data(one, key=PLAN_KEY, default=None)
    assert idx == list(range(len(samples))) and plan.tree is not None and plan.tree.num_samples == len(samples)
    # that micro-batch holds what verl's selection of every sample would, and keys set on it stay its own
    selected = tu.index_select_tensor_dict(whole, idx)
    assert one is not whole and sorted(one.keys()) == sorted(selected.keys())
    for key in selected.keys():
        got, want = one[key], selected[key]
        if isinstance(want, torch.Tensor) and want.is_nested:
            assert torch.equal(got.values(), want.values()) and torch.equal(got.offsets(), want.offsets()), key
        elif isinstance(want, torch.Tensor):
            assert torch.equal(got, want), key
        elif key != PLAN_KEY:
            assert list(got) == list(want) if hasattr(want, "__len__") and not isinstance(want, str) else got == want, key
    tu.assign_non_tensor(one, num_micro_batch=7)
    assert tu.get_non_tensor_data(whole, key="num_micro_batch", default=None) is None
    batches, indices = prefix_aware_micro_batches(td, min_num_micro_batch=len(samples))
    assert sorted(i for part in indices for i in part) == list(range(len(samples)))
    assert all(len(part) == 1 for part in indices)
    with pytest.raises(ValueError, match="cannot form"):
        prefix_aware_micro_batches(td, min_num_micro_batch=len(samples) + 1)


def test_tree_settings_from_the_environment(monkeypatch):
    from ps_bridge.config import PrefixSharingConfig

    monkeypatch.setenv("PS_BRIDGE_TREE", "1")
    monkeypatch.setenv("PS_BRIDGE_TREE_MIN_SHARED", "0")
    monkeypatch.setenv("PS_BRIDGE_TREE_MAX_DEPTH", "3")
    cfg = PrefixSharingConfig.from_env(enabled=True)
    assert (cfg.tree, cfg.tree_min_shared, cfg.tree_max_depth, cfg.layout_share()) == (True, 0, 3, "tree")
    monkeypatch.setenv("PS_BRIDGE_TREE_MIN_SHARED", "sixteen")
    with pytest.raises(ValueError, match="PS_BRIDGE_TREE_MIN_SHARED"):
        PrefixSharingConfig.from_env(enabled=True)
