"""Step 3 of the layout: materialize the pack's tensors and the way back.

Given the samples' flattened sequences, the prefix tree (step 1, `ps_bridge.tree.decide`) and the
pack order (step 2, `ps_bridge.tree.order`): one segment per node in pack order, padded at its end
to `pad_multiple` (the last one further, so the pack is a multiple of `total_multiple`); per token
its id, its position in its own sequence (padding continues the positions), its segment; per
segment the tree (parent, level, depth-first interval); and the way back, each sample's row of
`P_i + R_i` packed positions (its path from its root, a piece per node) with its own labels, and
the read positions when `prompt_values` is off. All numpy over the tokens, a Python step per node
of each sample's path only.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ps_bridge.packed_layout import PackedPrefixLayout, cumulative_offsets
from ps_bridge.tree.decide import PrefixTree
from ps_bridge.tree.level_buckets import RECENT_SHAPES
from ps_bridge.tree.order import PackOrder


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_length(n: int, multiple: int = 1) -> int:
    """The bucket a segment of `n` tokens is padded to under `bucket=True`: the smallest of 16, 24, 32,
    48, 64, 96, ... (powers of two and one and a half times them) that holds `n`, rounded up to
    `multiple`. At most a third of a bucket is padding; few buckets make layouts of one structure
    recur (a CUDA graph replays only a structure it captured: `ps_bridge.cuda_graphs`)."""
    b = 16
    while b < n:
        b = b * 3 // 2 if b & (b - 1) == 0 else b // 3 * 4
    return _padded(b, multiple)


def level_lengths(tree: PrefixTree, order: PackOrder, pad_multiple: int = 1, total_multiple: int = 1):
    """(each segment's length in pack order, the `LevelShape`) under level buckets: its own length
    (`pad_multiple`), and on a level's last segment the rest of the level's block, the blocks those the
    process's recent shapes give this tree shape (`level_buckets.RECENT_SHAPES`)."""
    valid = (tree.node_end[order.nodes] - tree.node_start[order.nodes]).tolist()
    own = [_padded(n, pad_multiple) for n in valid]
    spans = list(zip(order.level_offsets, order.level_offsets[1:]))
    tree_shape = (tuple(order.level_offsets), tuple(order.parent.tolist()), pad_multiple, total_multiple)
    shape = RECENT_SHAPES.choose(tree_shape, [own[a:b] for a, b in spans], pad_multiple, total_multiple)
    for (a, b), block in zip(spans, shape.blocks):
        own[b - 1] += block - sum(own[a:b])
    return own, shape


def bucketed_lengths(tree: PrefixTree, order: PackOrder, pad_multiple: int = 1, level_buckets: bool = False,
                     total_multiple: int = 1) -> List[int]:
    """Each segment's length in pack order under `bucket=True`: the `bucket_length` of its tree level's
    longest segment; with `level_buckets`, `level_lengths`'."""
    if level_buckets:
        return level_lengths(tree, order, pad_multiple, total_multiple)[0]
    nodes = order.nodes
    valid = (tree.node_end[nodes] - tree.node_start[nodes]).tolist()
    level_length = [bucket_length(max(valid[a:b]), pad_multiple)
                    for a, b in zip(order.level_offsets, order.level_offsets[1:])]
    return [level_length[d] for d in order.level.tolist()]


def bucketed_tokens(tree: PrefixTree, order: PackOrder, pad_multiple: int = 1, total_multiple: int = 1,
                    level_buckets: bool = False) -> int:
    """The tokens of the bucketed pack of `tree` (`materialize(..., bucket=True)`), from host integers:
    what the sharing rule weighs against the samples' own tokens before anything is packed."""
    return _padded(sum(bucketed_lengths(tree, order, pad_multiple, level_buckets, total_multiple)), total_multiple)


def bucketed_read_positions(read: np.ndarray, answer: np.ndarray, segment: np.ndarray, seg_start: np.ndarray,
                            padded: np.ndarray, valid_lengths: List[int], level_spans, whole_levels: bool):
    """(the positions a bucketed shared pack runs its output layer on, each segment's read kind). A
    segment that holds response tokens (or reads other than its last token) lists every position of it
    (kind 2), one that only ends prompts lists its last valid token (kind 1: a fork), one that rows do
    not read nothing (kind 0); with `whole_levels` (level buckets, where segments keep their own
    lengths) a level with a kind-2 segment lists its whole block. The count then follows the kinds and
    the buckets (the structure), not the lengths inside them; the positions listed that no row reads
    (prompt tokens before a fork, padding) are computed and never read, their gradient zero."""
    N = seg_start.size
    reads = np.bincount(segment[read], minlength=N)
    last = seg_start + np.asarray(valid_lengths, dtype=np.int64) - 1
    fork_only = (reads == 1) & read[np.maximum(last, 0)] & (np.asarray(valid_lengths) > 0)
    kinds = np.where((np.bincount(segment[answer], minlength=N) > 0) | ((reads > 0) & ~fork_only), 2,
                     np.where(reads > 0, 1, 0))
    # one run of positions per segment: all of it (kind 2), its last valid token (kind 1), none (kind 0)
    starts = np.where(kinds == 2, seg_start, np.maximum(last, 0)).astype(np.int64)
    lengths = np.where(kinds == 2, padded, kinds).astype(np.int64)
    if whole_levels:  # a level with a kind-2 segment: one run over its whole block
        for a, b in level_spans:
            if (kinds[a:b] == 2).any():
                starts[a], lengths[a] = seg_start[a], seg_start[b - 1] + padded[b - 1] - seg_start[a]
                lengths[a + 1:b] = 0
    runs, offsets = _repeat_arange(lengths)
    return starts[runs] + offsets, kinds.tolist()


def _repeat_arange(lengths: np.ndarray):
    """`(index of the run, offset inside the run)` for runs of `lengths`, concatenated."""
    runs = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return runs, np.arange(int(lengths.sum()), dtype=np.int64) - starts[runs]


def materialize(
    flat: np.ndarray,
    offsets: np.ndarray,
    prompt_lengths: np.ndarray,
    tree: PrefixTree,
    order: PackOrder,
    *,
    shared: bool,
    pad_multiple: int = 1,
    total_multiple: int = 1,
    pad_token_id: int = 0,
    prompt_values: bool = True,
    vocab_size: Optional[int] = None,
    bucket: bool = False,
    level_buckets: bool = False,
) -> PackedPrefixLayout:
    """Step 3: the tensors of the pack in `order` (one segment per node, padded at its end to
    `pad_multiple`, the last one further to make the pack a multiple of `total_multiple`) and the
    way back (each sample's row of `P_i + R_i` packed positions and labels).

    `bucket=True`: every segment of a tree level is padded to one length, the `bucket_length` of the
    level's longest, so the pack's shape depends on the tree's shape and the levels' buckets only,
    not on each segment's length; a shared pack without `prompt_values` runs the output layer on the
    positions `bucketed_read_positions` lists, a count the structure fixes. `level_buckets` (with `bucket`):
    segments keep their own lengths and each level's block is padded to a bucket instead, the padding
    on the level's last segment (`level_lengths`, `ps_bridge.tree.level_buckets`)."""
    nodes = order.nodes
    N = nodes.size
    B = tree.num_samples
    start, end, owner = tree.node_start[nodes], tree.node_end[nodes], tree.node_sample[nodes]
    valid_lengths = (end - start).tolist()
    if level_buckets and not bucket:
        raise ValueError("level_buckets=True needs bucket=True")
    segment_bound = None
    if level_buckets:
        padded_lengths, shape = level_lengths(tree, order, pad_multiple, total_multiple)
        segment_bound = shape.bound  # the longest element of the attention's causal call
    elif bucket:
        padded_lengths = bucketed_lengths(tree, order, pad_multiple)
    else:
        padded_lengths = [_padded(n, pad_multiple) for n in valid_lengths]
    padded_lengths[-1] += _padded(sum(padded_lengths), total_multiple) - sum(padded_lengths)
    seg_offsets = cumulative_offsets(padded_lengths)
    level_spans = list(zip(order.level_offsets, order.level_offsets[1:]))
    own = [_padded(n, pad_multiple) for n in valid_lengths]  # each segment without its level's padding
    cu_valid = cumulative_offsets(valid_lengths)
    padded = np.asarray(padded_lengths, dtype=np.int64)
    seg_start = np.asarray(seg_offsets[:-1], dtype=np.int64)

    # per token: its segment and its offset inside the segment (padding continues the positions so
    # RoPE tables stay monotone; padding is never attended to)
    segment, within = _repeat_arange(padded)
    positions = start[segment] + within
    valid = within < (end - start)[segment]
    tokens = np.full(segment.size, pad_token_id, dtype=np.int64)
    token_source = np.full(segment.size, -1, dtype=np.int64)  # flat index of each token (-1: padding)
    token_source[valid] = (offsets[owner] + start)[segment[valid]] + within[valid]
    tokens[valid] = flat[token_source[valid]]

    # each segment's root (parents come in earlier levels)
    root = np.arange(N, dtype=np.int64)
    for d in range(1, order.depth + 1):
        k = np.arange(order.level_offsets[d], order.level_offsets[d + 1])
        root[k] = root[order.parent[k]]
    is_root = order.level == 0
    terminal = order.pack_index[tree.sample_node]
    sample_group = root[terminal]
    num_roots = order.level_offsets[1]
    group_size = np.bincount(sample_group, minlength=num_roots)

    # the way back: each sample's path from its root, one piece of row per node
    lengths = np.diff(offsets)
    path_nodes: List[int] = []
    path_count = np.empty(B, dtype=np.int64)
    parent = order.parent.tolist()
    for i, k in enumerate(terminal.tolist()):
        path = []
        while k >= 0:
            path.append(k)
            k = parent[k]
        path_nodes.extend(reversed(path))
        path_count[i] = len(path)
    path_nodes = np.asarray(path_nodes, dtype=np.int64)
    path_sample = np.repeat(np.arange(B, dtype=np.int64), path_count)
    piece = np.minimum(end[path_nodes], lengths[path_sample]) - start[path_nodes]
    row_node = np.repeat(path_nodes, piece)
    row_sample, row_t = _repeat_arange(lengths)
    row_source = seg_start[row_node] + row_t - start[row_node]
    row_label = np.empty_like(flat)
    row_label[:-1] = flat[1:]
    row_label[offsets[1:] - 1] = -1
    output_positions = output_keep = None
    read_kinds = None  # under buckets, each segment's kind of read positions (`bucketed_read_positions`)
    if shared and not prompt_values:
        # what verl's losses read: row positions P_i - 1 on (each response, with its fork position)
        # (a mask over the pack, not a sort: linear in the tokens)
        read = np.zeros(segment.size, dtype=bool)
        read[row_source[row_t >= prompt_lengths[row_sample] - 1]] = True
        read_at = np.flatnonzero(read)
        if bucket:
            answer = np.zeros(segment.size, dtype=bool)  # the response tokens' positions
            answer[row_source[row_t >= prompt_lengths[row_sample]]] = True
            read_at, read_kinds = bucketed_read_positions(read, answer, segment, seg_start, padded, valid_lengths,
                                                          level_spans, whole_levels=level_buckets)
            output_keep = torch.from_numpy(np.flatnonzero(read[read_at]))  # the listed positions rows read
        output_positions = torch.from_numpy(read_at)

    as_long = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))  # noqa: E731
    level_list = order.level.tolist()
    host = dict(
        read_kinds=read_kinds,
        valid_lengths=valid_lengths,
        padded_lengths=padded_lengths,
        cu_seqlens=cu_valid,
        cu_seqlens_padded=seg_offsets,
        segment_group=root.tolist(),
        segment_is_prompt=is_root.tolist(),
        group_size=group_size.tolist(),
        max_valid_length=max(valid_lengths),
        max_padded_length=max(padded_lengths),
        segment_parent=parent,
        segment_level=level_list,
        level_offsets=list(order.level_offsets),
        depth=order.depth,
        token_source=token_source,
        level_blocks=[seg_offsets[b] - seg_offsets[a] for a, b in level_spans],
        own_lengths=own,
        segment_bound=segment_bound,
    )
    return PackedPrefixLayout(
        tokens=as_long(tokens),
        positions=as_long(positions),
        segment_ids=as_long(segment),
        group_ids=as_long(root[segment]),
        is_prompt=torch.from_numpy(is_root[segment]),
        valid=torch.from_numpy(valid),
        segment_group=as_long(root),
        segment_is_prompt=torch.from_numpy(is_root.copy()),
        valid_lengths=torch.tensor(valid_lengths, dtype=torch.int32),
        padded_lengths=torch.tensor(padded_lengths, dtype=torch.int32),
        cu_seqlens=torch.tensor(cu_valid, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(seg_offsets, dtype=torch.int32),
        group_size=as_long(group_size),
        sample_group=as_long(sample_group),
        sample_segment=as_long(terminal),
        sample_prompt_length=as_long(prompt_lengths),
        sample_response_length=as_long(lengths - prompt_lengths),
        row_offsets=as_long(offsets),
        row_source=as_long(row_source),
        row_label=as_long(row_label),
        shared=shared,
        pad_multiple=pad_multiple,
        bucketed=bucket,
        level_buckets=level_buckets,
        num_prompt_segments=num_roots,
        tokens_unshared=int(offsets[-1]),
        tokens_shared=int(sum(valid_lengths)),
        host=host,
        vocab_size=vocab_size,
        output_positions=output_positions,
        output_keep=output_keep,
        segment_parent=as_long(order.parent),
        segment_level=as_long(order.level),
        segment_tin=as_long(order.tin),
        segment_tout=as_long(order.tout),
    )
