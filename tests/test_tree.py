"""The micro-batch as a prefix tree: the three layout steps, and the kernels on trees (CPU).

Layout: random trees (tree_cases) round-trip (every sample's row reads back its own tokens at its
own positions with its own labels), the trie holds each distinct prefix once, nodes split only where
sequences diverge, the pack goes level by level and depth first inside a level, the depth-first
intervals are those of the parent pointers, and the MoE token weights count the samples passing
through each position. Kernels: softmax attention (torch_ref, flex) and Gated DeltaNet (torch_ref)
on a tree pack equal the unshared computation, outputs and input gradients, on the same leaves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_layout import check_inverse_map
from tree_cases import count_trie_builds, distinct_prefixes, tree_samples
from ps_bridge.layout import Sample, build_layout
from ps_bridge.tree.decide import node_children, token_trie
from ps_bridge.tree.order import pack_order


def _flat(samples):
    seqs = [list(s.prompt) + list(s.response) for s in samples]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64)
    return np.asarray([t for x in seqs for t in x], dtype=np.int64), offsets


def check_tree_layout(layout, samples):
    """Structure of a tree layout (pack order, intervals, parents, rows along ancestor paths)."""
    check_inverse_map(layout, samples)
    parent = layout.segment_parent.tolist()
    level = layout.segment_level.tolist()
    tin, tout = layout.segment_tin.tolist(), layout.segment_tout.tolist()
    offsets = layout.level_offsets
    assert level == sorted(level) and offsets[-1] == layout.num_segments
    for s, p in enumerate(parent):
        assert offsets[level[s]] <= s < offsets[level[s] + 1]
        if p < 0:
            assert level[s] == 0
        else:
            assert level[s] == level[p] + 1 and tin[p] < tin[s] < tout[s] <= tout[p]
    for d in range(len(offsets) - 1):  # depth first inside a level
        assert tin[offsets[d] : offsets[d + 1]] == sorted(tin[offsets[d] : offsets[d + 1]])
    seg = layout.segment_ids
    for i in range(layout.num_samples):  # each row reads one ancestor path, root first
        a, b = int(layout.row_offsets[i]), int(layout.row_offsets[i + 1])
        path = torch.unique_consecutive(seg[layout.row_source[a:b]]).tolist()
        assert parent[path[0]] == -1 and all(parent[y] == x for x, y in zip(path, path[1:]))
        assert path[-1] == int(layout.sample_segment[i])


# ---- the three steps alone, on one small batch ----------------------------------------------------
#
# s0 = [9 9 1 | 2 3], s1 = [9 9 1 | 2 4], s2 = [9 9 | 5], s3 = [9 | 9 1] (a prefix of s0 and s1, ending
# inside their shared node). The radix tree: A = [9 9] (positions 0-2) with children B = [1 2] (2-4) and
# C = [5] (2-3); B's children D = [3] and E = [4] (4-5); s3 ends inside B.

STEP_SAMPLES = [Sample([9, 9, 1], [2, 3]), Sample([9, 9, 1], [2, 4]), Sample([9, 9], [5]), Sample([9], [9, 1])]


def _nodes_by_path(tree, flat, offsets):
    """Each node as the tokens of its path (its prefix up to its end) -> (start, end, parent's path),
    and each sample's terminal node as its path: node ids carry no order."""

    def path(n):
        i = int(tree.node_sample[n])
        return tuple(flat[offsets[i] : offsets[i] + int(tree.node_end[n])].tolist())

    nodes = {path(n): (int(tree.node_start[n]), int(tree.node_end[n]),
                       path(int(tree.node_parent[n])) if tree.node_parent[n] >= 0 else None)
             for n in range(tree.num_nodes)}
    assert len(nodes) == tree.num_nodes
    return nodes, [path(int(n)) for n in tree.sample_node]


def test_step1_token_trie_alone():
    """`token_trie` on the flattened sequences: the radix tree, with the threshold and the depth limit."""
    flat, offsets = _flat(STEP_SAMPLES)
    nodes, terminal = _nodes_by_path(token_trie(flat, offsets), flat, offsets)
    A, B, C, D, E = (9, 9), (9, 9, 1, 2), (9, 9, 5), (9, 9, 1, 2, 3), (9, 9, 1, 2, 4)
    assert nodes == {A: (0, 2, None), B: (2, 4, A), C: (2, 3, A), D: (4, 5, B), E: (4, 5, B)}
    assert terminal == [D, E, C, B]
    # min_shared=3: the 2-token root, where no sample ends, is pushed into its children
    nodes, terminal = _nodes_by_path(token_trie(flat, offsets, min_shared=3), flat, offsets)
    assert nodes == {B: (0, 4, None), C: (0, 3, None), D: (4, 5, B), E: (4, 5, B)} and terminal == [D, E, C, B]
    # max_depth=1: B's subtree becomes one leaf per sample through it, from B's start
    nodes, terminal = _nodes_by_path(token_trie(flat, offsets, max_depth=1), flat, offsets)
    assert nodes == {A: (0, 2, None), C: (2, 3, A), D: (2, 5, A), E: (2, 5, A), (9, 9, 1): (2, 3, A)}
    assert terminal == [D, E, C, (9, 9, 1)]
    # share classes: s2, of another class, shares nothing (its own root); the others' root is B
    nodes, terminal = _nodes_by_path(token_trie(flat, offsets, classes=[0, 0, 1, 0]), flat, offsets)
    assert nodes == {C: (0, 3, None), B: (0, 4, None), D: (4, 5, B), E: (4, 5, B)} and terminal == [D, E, C, B]


def _step_tree():
    """The tree of STEP_SAMPLES written by hand (node ids in no particular order): 0 = A, 1 = D, 2 = C,
    3 = B, 4 = E."""
    from ps_bridge.tree.decide import PrefixTree

    a = lambda *x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return PrefixTree(node_sample=a(2, 0, 2, 0, 1), node_start=a(0, 4, 2, 2, 4), node_end=a(2, 5, 3, 4, 5),
                      node_parent=a(-1, 3, 0, 0, 3), sample_node=a(1, 4, 2, 3))


def test_step2_pack_order_alone():
    """`pack_order` on a hand-written tree: level by level, depth first inside a level, siblings by
    their first sample; parents as pack indices; the depth-first intervals."""
    order = pack_order(_step_tree())
    assert order.nodes.tolist() == [0, 3, 2, 1, 4]  # A | B C | D E
    assert order.pack_index[order.nodes].tolist() == [0, 1, 2, 3, 4]  # its inverse
    assert order.level.tolist() == [0, 1, 1, 2, 2] and order.level_offsets == [0, 1, 3, 5] and order.depth == 2
    assert order.parent.tolist() == [-1, 0, 0, 1, 1]
    assert order.tin.tolist() == [0, 1, 4, 2, 3] and order.tout.tolist() == [5, 4, 5, 3, 4]


def test_step3_materialize_alone():
    """`materialize` of a hand-written tree and order: tokens, positions and padding per segment, the
    rows back (each sample's path, its own labels) and the read positions."""
    from ps_bridge.layout import _flatten
    from ps_bridge.tree.materialize import materialize

    flat, offsets, prompt_lengths = _flatten(STEP_SAMPLES, None)
    tree = _step_tree()
    layout = materialize(flat, offsets, prompt_lengths, tree, pack_order(tree), shared=True, pad_multiple=2,
                         total_multiple=4, pad_token_id=0, prompt_values=False)
    P = 0
    assert layout.tokens.tolist() == [9, 9, 1, 2, 5, P, 3, P, 4, P, P, P]  # A B C D E, the last padded to 12
    assert layout.positions.tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7]
    assert layout.valid.tolist() == [True] * 5 + [False, True, False, True, False, False, False]
    assert layout.host["cu_seqlens_padded"] == [0, 2, 4, 6, 8, 12] and layout.host["cu_seqlens"] == [0, 2, 4, 5, 6, 7]
    assert layout.segment_parent.tolist() == [-1, 0, 0, 1, 1] and layout.tree_depth == 2
    assert layout.sample_segment.tolist() == [3, 4, 2, 1] and layout.group_size.tolist() == [4]
    rows = [r.tolist() for r in torch.split(layout.row_source, layout.row_offsets.diff().tolist())]
    labels = [r.tolist() for r in torch.split(layout.row_label, layout.row_offsets.diff().tolist())]
    assert rows == [[0, 1, 2, 3, 6], [0, 1, 2, 3, 8], [0, 1, 4], [0, 1, 2]]
    assert labels == [[9, 1, 2, 3, -1], [9, 1, 2, 4, -1], [9, 5, -1], [9, 1, -1]]
    # read from row position P_i - 1 on: s0, s1 from 2, s2 from 1, s3 from 0
    assert layout.output_positions.tolist() == [0, 1, 2, 3, 4, 6, 8]
    assert (layout.tokens_shared, layout.tokens_unshared) == (7, 16)
    # the three steps are what build_layout runs
    built = build_layout(STEP_SAMPLES, share="tree", min_shared=0, pad_multiple=2, total_multiple=4, prompt_values=False)
    assert built.tokens.tolist() == layout.tokens.tolist() and built.row_source.tolist() == layout.row_source.tolist()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), pad=st.sampled_from([1, 2, 4]), total=st.sampled_from([1, 8]))
def test_tree_layout_round_trip_on_random_trees(seed, pad, total):
    from ps_bridge.models.packed_seq import moe_token_weights

    samples = tree_samples(seed)
    layout = build_layout(samples, share="tree", min_shared=0, pad_multiple=pad, total_multiple=total)
    check_tree_layout(layout, samples)
    counts = distinct_prefixes(samples)
    assert layout.tokens_shared == len(counts)  # each distinct prefix stored once
    assert layout.num_tokens % total == 0 and all(n % pad == 0 for n in layout.host["padded_lengths"][:-1])
    # nodes split only where sequences diverge: siblings begin with different tokens, and a node
    # with a single child is one where some sample ends
    children = [[] for _ in range(layout.num_segments)]
    for s, p in enumerate(layout.segment_parent.tolist()):
        if p >= 0:
            children[p].append(s)
    starts = layout.cu_seqlens_padded.tolist()
    ends_here = set(layout.sample_segment.tolist())
    for s, kids in enumerate(children):
        assert len({int(layout.tokens[starts[k]]) for k in kids}) == len(kids)
        assert len(kids) != 1 or s in ends_here
    # MoE token weights: how many samples pass through each position
    weights = moe_token_weights(layout)
    assert float(weights[~layout.valid].abs().sum()) == 0.0
    for i, s in enumerate(samples):
        seq = tuple(s.prompt) + tuple(s.response)
        a = int(layout.row_offsets[i])
        for t in range(len(seq)):
            assert weights[layout.row_source[a + t]] == counts[seq[: t + 1]]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), min_shared=st.integers(1, 12), max_depth=st.sampled_from([None, 0, 1, 2]))
def test_threshold_and_depth_limit(seed, min_shared, max_depth):
    samples = tree_samples(seed)
    layout = build_layout(samples, share="tree", min_shared=min_shared, max_depth=max_depth)
    check_tree_layout(layout, samples)
    full = build_layout(samples, share="tree", min_shared=0)
    assert full.tokens_shared <= layout.tokens_shared <= layout.tokens_unshared
    if max_depth is not None:
        assert layout.tree_depth <= max_depth
    # a run shared by several samples (an inner node) where no sample ends is at least min_shared long,
    # unless the prompt that two or more of its samples share ends in it (a group's whole prompt is shared)
    parent, lengths = layout.segment_parent.tolist(), layout.host["valid_lengths"]
    parents = set(parent) - {-1}
    ends_here = set(layout.sample_segment.tolist())
    for s in parents - ends_here:
        if lengths[s] >= min_shared:
            continue
        prompt_ends = []  # (prompt, where it ends relative to the node's start) of the samples through s
        for i, sample in enumerate(samples):
            chain, seg = [], layout.sample_segment[i].item()
            while seg != -1:
                chain.append(seg)
                seg = parent[seg]
            if s in chain:
                start = sum(lengths[c] for c in chain[chain.index(s) + 1:])
                prompt_ends.append((tuple(sample.prompt), len(sample.prompt) - start))
        inside = [p for p, end in prompt_ends if 0 < end <= lengths[s]]
        assert any(inside.count(p) >= 2 for p in inside), (s, lengths[s], min_shared)


def test_trie_shapes():
    system = [9, 9, 9, 9]
    samples = [
        Sample(system + [1, 2], [3, 4]),
        Sample(system + [1, 2], [3, 5]),
        Sample(system + [7], [8]),
        Sample(system + [1], [2]),  # a prefix of the first two: ends inside their node
        Sample(system + [7], [8]),  # identical to sample 2
    ]
    layout = build_layout(samples, share="tree", min_shared=0)
    # root: the system prompt; level 1: [1, 2, 3] and [7, 8]; level 2: [4] and [5]
    assert layout.tree_depth == 2 and layout.num_segments == 5
    assert layout.host["valid_lengths"] == [4, 3, 2, 1, 1]
    assert layout.tokens_shared == 11
    assert layout.sample_segment.tolist() == [3, 4, 2, 1, 2]
    assert layout.group_size.tolist() == [5]
    check_tree_layout(layout, samples)
    # a one-token shared run that is part of two prompts is not shared at min_shared=2
    shallow = build_layout([Sample([5, 7], [1, 2, 3]), Sample([5, 8], [4, 6])], share="tree", min_shared=2)
    assert shallow.tree_depth == 0 and shallow.tokens_shared == shallow.tokens_unshared
    # but a whole prompt shared by all its responses is, whatever its length (as one level shares it)
    short = build_layout([Sample([5], [1, 2, 3]), Sample([5], [4, 6])], share="tree", min_shared=2)
    assert short.tree_depth == 1 and short.host["valid_lengths"] == [1, 3, 2]


def test_one_level_layout_is_the_depth_one_tree():
    samples = [Sample([1, 2, 3], [4]), Sample([9, 9], [1, 2]), Sample([1, 2, 3], [5, 6]), Sample([9, 9], [3])]
    layout = build_layout(samples, share=True)
    assert layout.tree_depth == 1 and layout.level_offsets == [0, 2, 6]
    assert layout.segment_parent.tolist() == [-1, -1, 0, 0, 1, 1]
    check_tree_layout(layout, samples)
    unshared = build_layout(samples, share=False)
    assert unshared.tree_depth == 0 and unshared.level_offsets == [0, 4]
    check_tree_layout(unshared, samples)


def test_share_classes_never_share_a_position():
    samples = [Sample([1, 2, 3], [4, 5]), Sample([1, 2, 3], [4, 6]), Sample([1, 2, 3], [4, 5])]
    temperatures = [1.0, 0.7, 0.7]
    for share in ("tree", True):
        layout = build_layout(samples, share=share, min_shared=0, share_classes=temperatures)
        check_inverse_map(layout, samples)
        rows = [set(r.tolist()) for r in torch.split(layout.row_source, layout.row_offsets.diff().tolist())]
        assert not rows[0] & (rows[1] | rows[2]) and rows[1] & rows[2]


def test_sort_and_prefix_lengths_do_not_depend_on_sample_order():
    samples = tree_samples(0)
    flat, offsets = _flat(samples)
    tree = token_trie(flat, offsets)
    order = pack_order(tree)
    assert order.depth >= 1 and len(node_children(tree)) == tree.num_nodes
    reversed_layout = build_layout(samples[::-1], share="tree", min_shared=0)
    assert reversed_layout.tokens_shared == build_layout(samples, share="tree", min_shared=0).tokens_shared


def test_bad_tree_options_fail_clearly():
    samples = [Sample([1], [2])]
    with pytest.raises(ValueError, match="min_shared"):
        build_layout(samples, share="tree", min_shared=-1)
    with pytest.raises(ValueError, match="max_depth"):
        build_layout(samples, share="tree", max_depth=-1)
    with pytest.raises(ValueError, match="share must be"):
        build_layout(samples, share="trie")
    with pytest.raises(ValueError, match="share_classes"):
        build_layout(samples, share="tree", share_classes=[1.0, 2.0])


# ---- kernels on trees: the tree pack against the unshared pack on the same leaves ---------------------


def _unshared_view(leaf, tree_layout, flat_layout):
    """The unshared pack's inputs read from the tree pack's leaf (each unshared position takes the
    leaf value of the tree position holding the same prefix): both runs differentiate one leaf."""
    index = torch.zeros(flat_layout.num_tokens, dtype=torch.long)
    index[flat_layout.row_source] = tree_layout.row_source
    return leaf.index_select(0, index)


def _rows(out, layout):
    return out.index_select(0, layout.row_source)


@pytest.mark.parametrize("backend", ["torch_ref", "flex"])
@pytest.mark.parametrize("seed", [0, 2])
def test_attention_on_trees_equals_unshared(backend, seed):
    from ps_bridge.kernels.attention import get_attention_backend

    samples = tree_samples(seed)
    tree = build_layout(samples, share="tree", min_shared=0, pad_multiple=2)
    flat = build_layout(samples, share=False)
    assert tree.tree_depth >= 2
    gen = torch.Generator().manual_seed(seed)
    grad = backend != "flex"  # FlexAttention has no backward on the CPU
    q, k, v = (torch.randn(tree.num_tokens, heads, 8, generator=gen, requires_grad=grad) for heads in (4, 2, 2))
    attend = get_attention_backend(backend)
    out_tree = _rows(attend(q, k, v, tree, 0.3), tree)
    out_flat = _rows(attend(*(_unshared_view(x, tree, flat) for x in (q, k, v)), flat, 0.3), flat)
    torch.testing.assert_close(out_tree, out_flat, rtol=1e-5, atol=1e-5)
    if not grad:
        return
    w = torch.randn(out_flat.shape, generator=gen)
    g_tree = torch.autograd.grad((out_tree * w).sum(), (q, k, v))
    g_flat = torch.autograd.grad((out_flat * w).sum(), (q, k, v))
    for a, b in zip(g_tree, g_flat):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["flash_atten_gpu", "flash_atten_gpu_expand"])
def test_one_level_backends_run_depth_one_tries(backend):
    """A trie cut at depth 1 (roots shared by different prompts, samples ending inside a root) is a
    one-level layout: the cascade and expand designs (torch's CPU flash op, float64) equal torch_ref."""
    from test_attention_backends import qkv, run

    layout = build_layout(tree_samples(5), share="tree", min_shared=0, max_depth=1, pad_multiple=2)
    assert layout.tree_depth == 1
    q, k, v = qkv(layout, 4, 2, 64, torch.float64)
    grad_out = torch.randn_like(q)
    out, grads = run(backend, q, k, v, layout, grad_out)
    ref, ref_grads = run("torch_ref", q, k, v, layout, grad_out)
    torch.testing.assert_close(out[layout.valid], ref[layout.valid], rtol=1e-9, atol=1e-9)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["flash_atten_gpu_expand", "flash_atten_npu"])
def test_one_level_backends_refuse_deeper_trees(backend):
    from ps_bridge.kernels.attention import get_attention_backend, resolve_attention_backend

    tree = build_layout(tree_samples(0), share="tree", min_shared=0)
    q = torch.zeros(tree.num_tokens, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"backend '{backend}' runs prefix trees of depth <= 1.*--no-tree "
                                         r"\(under verl PS_BRIDGE_TREE=0"):
        get_attention_backend(backend)(q, q, q, tree, 1.0)
    assert resolve_attention_backend("auto", q, tree.tree_depth).name == "torch_ref"
    assert resolve_attention_backend("auto", q.cuda() if torch.cuda.is_available() else q, tree.tree_depth).name in ("flash_atten_gpu", "torch_ref")


@pytest.mark.parametrize("seed, width", [(0, 4), (3, 2)])
def test_gated_delta_net_on_trees_equals_unshared(seed, width):
    from ps_bridge.kernels.gdn import plan_from_layout, prefix_shared_gated_delta_net, resolve_gdn_backend

    samples = tree_samples(seed)
    tree = build_layout(samples, share="tree", min_shared=0, pad_multiple=2)
    flat = build_layout(samples, share=False)
    assert tree.tree_depth >= 2 and min(tree.host["valid_lengths"]) < width  # nodes shorter than the conv
    H, K, HV, V = 2, 4, 4, 3
    D = 2 * H * K + HV * V
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    mixed = torch.randn(tree.num_tokens, D, generator=gen, dtype=dt, requires_grad=True)
    g = (-torch.rand(tree.num_tokens, HV, generator=gen, dtype=dt) * 0.5).requires_grad_(True)
    beta = torch.rand(tree.num_tokens, HV, generator=gen, dtype=dt, requires_grad=True)
    weight = torch.randn(D, width, generator=gen, dtype=dt, requires_grad=True)
    bias = torch.randn(D, generator=gen, dtype=dt, requires_grad=True)
    ref = resolve_gdn_backend("torch_ref", torch.device("cpu"))

    def run(layout, inputs):
        out = prefix_shared_gated_delta_net(
            *inputs, weight, bias, plan_from_layout(layout), ref, num_key_heads=H, key_head_dim=K, value_head_dim=V,
        )
        return _rows(out, layout)

    out_tree = run(tree, (mixed, g, beta))
    out_flat = run(flat, [_unshared_view(x, tree, flat) for x in (mixed, g, beta)])
    assert plan_from_layout(tree).depth == tree.tree_depth
    assert (out_tree - out_flat).abs().max() < 1e-12
    w = torch.randn(out_flat.shape, generator=gen, dtype=dt)
    leaves = (mixed, g, beta, weight, bias)
    for a, b in zip(torch.autograd.grad((out_tree * w).sum(), leaves), torch.autograd.grad((out_flat * w).sum(), leaves)):
        assert ((a - b).abs().max() / b.abs().max()) < 1e-12


def test_auto_picks_fla_on_trees_on_cuda():
    """fla runs trees of any depth (one call per level; tests/test_gdn_fla_gpu.py on a GPU)."""
    from ps_bridge.kernels.gdn import choose_gdn_backend

    assert choose_gdn_backend(torch.device("cuda"), tree_depth=3) == "fla"
    assert choose_gdn_backend(torch.device("cpu"), tree_depth=3) == "torch_ref"


def test_parallel_settings_accept_trees():
    """The parallel settings' one check knows nothing of trees (they run under every layout it accepts)."""
    import inspect

    from ps_bridge.parallel.settings import ParallelSettings

    assert list(inspect.signature(ParallelSettings.check_supported).parameters) == ["self"]
    for settings_ in (ParallelSettings(), ParallelSettings(tp=2, sequence_parallel=True), ParallelSettings(pp=2),
                      ParallelSettings(cp=2), ParallelSettings(ep=2)):
        settings_.check_supported()


# ---- the tree decided once per micro-batch (the sharing rule's counts and the layout) -------------


def test_layout_from_a_decided_tree_equals_the_layout_deciding_it():
    from ps_bridge.layout import decide_tree

    samples = tree_samples(3)
    for share, options in (("tree", dict(min_shared=0)), ("tree", dict(min_shared=4, max_depth=2)), (True, {}), (False, {})):
        tree = decide_tree(samples, share, **options)
        given = build_layout(samples, share=share, tree=tree, pad_multiple=2, total_multiple=8, prompt_values=False)
        decided = build_layout(samples, share=share, pad_multiple=2, total_multiple=8, prompt_values=False, **options)
        for name, value in decided.__dict__.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, getattr(given, name)), (share, name)
        assert given.host["level_offsets"] == decided.host["level_offsets"]
    tree = decide_tree(samples, "tree", min_shared=0)
    with pytest.raises(ValueError, match="decide it from the same samples"):
        build_layout(samples[1:], share="tree", tree=tree)
    other = [Sample(s.prompt + [1], s.response) for s in samples]
    with pytest.raises(ValueError, match="decide it from the same samples"):
        build_layout(other, share="tree", tree=tree)
    with pytest.raises(ValueError, match="out of the vocabulary"):  # a given tree's ids are still checked
        build_layout(samples, share="tree", tree=tree, vocab_size=4)


def test_make_layout_builds_the_trie_once_and_the_rule_reads_it(qwen2_loaded, monkeypatch, caplog):
    """`make_layout` (`prepare.micro_batch_layout`, the verl engine's step too): one trie build, the rule
    reading it, and the `[PS][prepare]` lines: the decision, then the layout with the tree's depth, node
    count and trie tokens."""
    import logging

    from ps_bridge.launch_rule import MicroBatchCounts, sharing_for
    from ps_bridge.layout import decide_tree
    from ps_bridge.tools.runtime import make_layout

    samples = tree_samples(0)
    config = qwen2_loaded.config
    saved = (config.tree, config.tree_min_shared)
    config.tree, config.tree_min_shared = True, 0
    built = count_trie_builds(monkeypatch)
    try:
        with caplog.at_level(logging.INFO, logger="ps_bridge"):
            layout = make_layout(samples, qwen2_loaded)  # share=None: the rule decides, then the layout packs
        assert len(built) == 1
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[PS][prepare][")]
        assert len(lines) == 2 and " sharing: shared: " in lines[0], lines
        assert " packed_batch_layout: " in lines[1] and lines[1].endswith(
            f"depth={layout.tree_depth}, nodes={layout.num_segments}, trie_tokens={layout.tokens_shared}")
        tree = decide_tree(samples, "tree", min_shared=0)
        del built[:]
        with_tree = sharing_for(samples, config, qwen2_loaded.model_cost, "cpu", "float32", trie=tree)
        assert not built  # the rule reads the given tree's count
        without = sharing_for(samples, config, qwen2_loaded.model_cost, "cpu", "float32")
    finally:
        config.tree, config.tree_min_shared = saved
    assert layout.tree_depth >= 2 and layout.tokens_shared == tree.trie_tokens
    assert layout.num_segments == tree.num_nodes  # pad_multiple 1: one segment per node
    assert with_tree == without and len(built) == 1
    counts = MicroBatchCounts.of(samples, tree=True, min_shared=0, trie=tree)
    assert counts == MicroBatchCounts.of(samples, tree=True, min_shared=0)


# ---- the micro-batching's costs: the tree and its order, no materialized pack ---------------------------


@pytest.mark.parametrize("seed", range(6))
def test_split_costs_of_the_tree_and_its_order_equal_the_built_layouts(seed):
    """The verl engine's micro-batching reads the tree and its pack order (`packed_costs`), not a
    materialized pack: the same node costs and places, units and micro-batches as the built layout's
    (`layout_costs`), for trees and the one-level layout, with and without padding."""
    from dataclasses import fields

    from ps_bridge.layout import decide_tree
    from ps_bridge.tree.split import budget_micro_batches, layout_costs, packed_costs

    samples = tree_samples(seed, vocab=8, max_samples=24)
    longest = max(len(s.prompt) + len(s.response) for s in samples)
    for share, pad in (("tree", 1), ("tree", 4), (True, 2)):
        min_shared = 0 if share == "tree" else None
        tree = decide_tree(samples, share, min_shared=min_shared)
        _, offsets, prompts = tree.sequences
        costs = packed_costs(tree, pack_order(tree), np.diff(offsets), prompts, pad)
        built = layout_costs(build_layout(samples, share=share, pad_multiple=pad, min_shared=min_shared))
        for f in fields(costs):
            assert np.array_equal(getattr(costs, f.name), getattr(built, f.name)), (share, pad, f.name)
        for budget in (-(-longest // pad) * pad + seed % 3 * 5, 4 * longest):
            parts = budget_micro_batches(costs, budget)
            assert parts == budget_micro_batches(build_layout(samples, share=share, pad_multiple=pad,
                                                              min_shared=min_shared), budget)
            assert sorted(i for p in parts for i in p) == list(range(len(samples)))


# ---- expert / data parallelism: whole subtrees per rank ----------------------------------------------


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), dp=st.sampled_from([2, 3]))
def test_split_subtrees_gives_whole_subtrees_to_every_rank(seed, dp):
    """Every sample on one rank, every rank some; a rank's samples are whole subtrees: a node below the
    split is on one rank only, and only the nodes above it (a shared root such as the system prompt)
    are on several."""
    from ps_bridge.tools.data_parallel import split_subtrees
    from ps_bridge.layout import decide_tree

    samples = tree_samples(seed)
    tree = decide_tree(samples, "tree", min_shared=0)
    if len(samples) < dp:
        with pytest.raises(ValueError, match="fewer than the .* data-parallel ranks"):
            split_subtrees(tree, dp)
        return
    shares = split_subtrees(tree, dp)
    assert sorted(i for s in shares for i in s) == list(range(len(samples))) and all(shares)
    # the nodes each rank computes: its samples' paths
    parent = tree.node_parent.tolist()

    def path(i):
        n, out = int(tree.sample_node[i]), set()
        while n >= 0:
            out.add(n)
            n = parent[n]
        return out

    held = [set().union(*(path(i) for i in s)) for s in shares]
    on_several = {n for n in range(tree.num_nodes) if sum(n in h for h in held) > 1}
    for n in on_several:  # a node on several ranks has all its ancestors on them too (a shared top)
        assert parent[n] < 0 or parent[n] in on_several
    # each rank's layout of its part is exact as a tree of its own (the layout round trip)
    for s in shares:
        part = [samples[i] for i in s]
        check_tree_layout(build_layout(part, share="tree", min_shared=0), part)


def test_split_subtrees_splits_a_system_prompt_shared_by_the_whole_batch():
    from ps_bridge.tools.data_parallel import split_groups, split_subtrees
    from ps_bridge.layout import decide_tree

    system = list(range(100, 140))
    samples = [Sample(system + [p] * 6, [p, r]) for p in range(4) for r in range(3)]
    shares = split_subtrees(decide_tree(samples, "tree", min_shared=0), 2)
    prompts = [{tuple(samples[i].prompt) for i in s} for s in shares]
    assert [len(s) for s in shares] == [6, 6] and not prompts[0] & prompts[1]  # whole prompts, the system on both
    # identical prompts (share=True, the one-level tree): whole groups, as `split_groups` gives them
    by_groups = split_subtrees(decide_tree(samples, True), 2)
    assert sorted(map(sorted, by_groups)) == sorted(map(sorted, split_groups(samples, 2)))
    # one path (each sample a prefix of the next) still splits: its node on both ranks
    chain = [Sample([1, 2, 3], [4]), Sample([1, 2, 3, 4], [5]), Sample([1, 2, 3, 4, 5], [6])]
    assert sorted(map(len, split_subtrees(decide_tree(chain, "tree", min_shared=0), 2))) == [1, 2]


def test_logprobs_cli_decides_sharing_once(tmp_path, qwen2_checkpoint, monkeypatch):
    """`ps-bridge logprobs --tree`: the sharing rule runs once for the batch (its decision is what the
    output reports and what every rank runs), the tree of the batch is decided once for it."""
    import json

    import ps_bridge.launch_rule as launch_rule
    import ps_bridge.prepare as prepare
    from ps_bridge.tools.cli import main

    calls = []
    real = launch_rule.sharing_for

    def counted(*args, **kwargs):
        calls.append(kwargs.get("trie"))
        return real(*args, **kwargs)

    monkeypatch.setattr(launch_rule, "sharing_for", counted)
    monkeypatch.setattr(prepare, "sharing_for", counted)
    hf_path, _ = qwen2_checkpoint
    samples = tree_samples(2)
    batch = tmp_path / "b.json"
    batch.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    out = tmp_path / "out.json"
    assert main(["logprobs", "--hf-path", hf_path, "--batch", str(batch), "--out", str(out), "--tree",
                 "--tree-min-shared", "0"]) == 0
    got = json.loads(out.read_text())
    assert len(calls) == 1 and calls[0] is not None and calls[0].trie_tokens == got["tokens_shared"]
    assert got["shared_path"] is True and got["tree_depth"] >= 2 and got["tree_nodes"] == calls[0].num_nodes
