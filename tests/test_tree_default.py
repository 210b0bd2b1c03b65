"""Prefix trees by default (CPU): a GRPO group is a tree of depth one, packed exactly as one level of
sharing (the same tensors, so the same results and the same kernels); a tree never shares less than
one level (a whole prompt shared by its responses stays shared below `DEFAULT_MIN_SHARED`); the
setting's default and its off switches (`PS_BRIDGE_TREE=0`, `--no-tree`); the one-level attention
backends run depth-one trees and refuse deeper ones naming those switches."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
import numpy as np
import torch

from test_tree import check_tree_layout
from tree_cases import tree_samples
from ps_bridge.config import PrefixSharingConfig
from ps_bridge.layout import DEFAULT_MIN_SHARED, Sample, build_layout


def grpo_batch(seed: int, prompt_lengths=(25, 30, 70, 130), n: int = 4, chat_prefix: int = 20, vocab: int = 1000):
    """GRPO-shaped samples: prompts that begin with the same `chat_prefix` tokens (a chat template's
    header, shorter than the tree's threshold), each with n responses whose first tokens differ."""
    rng = random.Random(seed)
    header = [rng.randrange(vocab) for _ in range(chat_prefix)]
    samples = []
    for P in prompt_lengths:
        prompt = header[:P] + [rng.randrange(vocab) for _ in range(max(0, P - chat_prefix))]
        firsts = rng.sample(range(vocab), n)
        for first in firsts:
            samples.append(Sample(prompt, [first] + [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]))
    rng.shuffle(samples)  # members need not be adjacent
    return samples


def same(x, y) -> bool:
    """Equal values, tensors and arrays by dtype and every element, containers item by item."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    return x == y


def assert_same_layout(a, b):
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "host":
            # which sample's copy of a shared token the pack was read from (the images of that sample
            # are placed there): any member of the group holds the same tokens and images
            x, y = ({k: v for k, v in d.items() if k != "token_source"} for d in (x, y))
        assert same(x, y), f.name


@pytest.mark.core
@pytest.mark.parametrize("seed, pad, total, prompt_values", [(0, 1, 1, False), (1, 2, 4, False), (2, 4, 8, True)])
def test_a_grpo_group_packs_as_one_level(seed, pad, total, prompt_values):
    samples = grpo_batch(seed)
    options = dict(pad_multiple=pad, total_multiple=total, prompt_values=prompt_values, vocab_size=1000)
    tree = build_layout(samples, share="tree", **options)
    one_level = build_layout(samples, share=True, **options)
    assert tree.tree_depth == 1 and tree.num_groups == 4
    assert min(len(s.prompt) for s in samples) < DEFAULT_MIN_SHARED  # short prompts stay shared
    assert_same_layout(tree, one_level)


@pytest.mark.core
def test_the_default_config_packs_a_grpo_batch_as_one_level():
    """Through the one owner of the decision (`prepare.micro_batch_layout`) with the default config and
    with `tree=False`: the same decision and the same layout."""
    from ps_bridge.plan import SharingPlan
    from ps_bridge.prepare import micro_batch_layout

    samples = grpo_batch(3)
    default, one_level = PrefixSharingConfig(), PrefixSharingConfig(tree=False)
    assert default.tree and default.layout_share() == "tree" and one_level.layout_share() is True
    out = []
    for config in (default, one_level):
        layout, decision = micro_batch_layout(samples, config, None, "cpu", torch.float32,
                                              plan=SharingPlan.from_config(config), vocab_size=1000, total_multiple=1)
        out.append((layout, decision))
    (a, da), (b, db) = out
    assert da == db and da.share
    assert_same_layout(a, b)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("min_shared", [1, 3, DEFAULT_MIN_SHARED])
def test_a_tree_never_shares_less_than_one_level(seed, min_shared):
    """Random trees (system prompts, nested prompts, samples ending inside others, duplicates): the trie
    at any threshold stores no more tokens than one level, and every group's prompt is one node path
    shared by all its members."""
    samples = tree_samples(seed)
    tree = build_layout(samples, share="tree", min_shared=min_shared)
    one_level = build_layout(samples, share=True)
    check_tree_layout(tree, samples)
    assert tree.tokens_shared <= one_level.tokens_shared
    for group in _groups(samples):
        P = len(samples[group[0]].prompt)
        sources = {tuple(tree.row_source[int(tree.row_offsets[i]):int(tree.row_offsets[i]) + P].tolist()) for i in group}
        assert len(sources) == 1  # the prompt read from the same packed positions by every member


def _groups(samples):
    by_prompt = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(tuple(s.prompt), []).append(i)
    return list(by_prompt.values())


def test_nested_prompts_stay_shared_within_their_groups():
    """A short prompt that is the beginning of another group's prompt: its node is kept (its group's
    prompt ends there), where a threshold alone would have computed it once per response."""
    short, long = [1, 2, 3], [1, 2, 3, 4, 5]
    samples = [Sample(short, [7, 8]), Sample(short, [9]), Sample(long, [6]), Sample(long, [8, 8])]
    tree = build_layout(samples, share="tree", min_shared=64)
    assert tree.host["valid_lengths"][0] == 3  # [1 2 3] once
    assert tree.tokens_shared == 3 + 2 + 1 + 2 + 1 + 2 and tree.tree_depth == 2
    check_tree_layout(tree, samples)


def test_the_tree_setting_defaults_on_and_turns_off(monkeypatch):
    monkeypatch.delenv("PS_BRIDGE_TREE", raising=False)
    assert PrefixSharingConfig().tree and PrefixSharingConfig.from_env(enabled=True).tree
    for value, expected in (("", True), ("1", True), ("0", False), ("off", False)):
        monkeypatch.setenv("PS_BRIDGE_TREE", value)
        assert PrefixSharingConfig.from_env(enabled=True).tree is expected, value
    monkeypatch.setenv("PS_BRIDGE_TREE", "0")
    assert PrefixSharingConfig.from_env(enabled=True).layout_share() is True  # one level
    assert PrefixSharingConfig.from_env(enabled=True, tree=True).tree  # an explicit setting wins
    monkeypatch.setenv("PS_BRIDGE_TREE", "maybe")
    with pytest.raises(ValueError, match="PS_BRIDGE_TREE='maybe' is not a boolean"):
        PrefixSharingConfig.from_env(enabled=True)


def test_the_cli_takes_no_tree(monkeypatch):
    """`--no-tree` on logprobs, bench and verl-check; unset, the config's default decides."""
    from ps_bridge.tools.cli import build_parser

    parser = build_parser()
    base = ["logprobs", "--hf-path", "x", "--batch", "b.json", "--out", "o.json"]
    assert parser.parse_args(base).tree is None
    assert parser.parse_args(base + ["--no-tree"]).tree is False
    assert parser.parse_args(base + ["--tree"]).tree is True
    assert parser.parse_args(["bench"]).tree is None and parser.parse_args(["bench", "--no-tree"]).tree is False
    assert parser.parse_args(["verl-check", "--no-tree"]).tree is False
    assert parser.parse_args(["verl-check"]).tree is None


@pytest.mark.parametrize("backend", ["flash_atten_gpu_expand", "flash_atten_npu"])
def test_one_level_backends_run_the_default_tree_of_a_grpo_batch(backend):
    """The expand designs take the default (tree) layout of a GRPO batch, depth one; a deeper tree is
    refused naming --no-tree and PS_BRIDGE_TREE=0."""
    from ps_bridge.kernels.attention import get_attention_backend

    layout = build_layout(grpo_batch(4), share=PrefixSharingConfig().layout_share(), pad_multiple=2)
    assert layout.tree_depth == 1
    get_attention_backend(backend).check_tree_depth(layout.tree_depth)
    deeper = build_layout(tree_samples(0), share=PrefixSharingConfig().layout_share(), min_shared=0)
    assert deeper.tree_depth > 1
    with pytest.raises(ValueError, match=r"--no-tree \(under verl PS_BRIDGE_TREE=0"):
        get_attention_backend(backend).check_tree_depth(deeper.tree_depth)
