"""Where the Gated DeltaNet kernels find the tree's nodes, level by level, and the forks between them.

The GDN kernels run on *compacted* tokens: the valid tokens of every segment (node of the prefix
tree) in pack order, which is level by level (`ps_bridge.tree.order`): all roots (prompts, or every
sample when unshared), then all their children (responses), and so on. Padding (which the packed
layout puts at the end of each segment) is left out, so a node's final conv and recurrent states
are taken at its last *valid* token, and padding never enters any state. Each level is one varlen
batch: one delta-rule call per level, each node starting from its parent's final state (the parent
is in the previous level: `GDNLevel.parent`). The conv runs once over all nodes, each node starting
from the last inputs of its ancestor path (`conv_tail_index`).

A plan is built from the packed THD layout (`plan_from_layout`); `build_plan` is its general form.

A bucketed layout (`PackedPrefixLayout.bucketed`: every segment of a level padded to one bucket
length) is planned on its padded segments instead, so that the kernels' shapes follow its structure
only: nothing is compacted, the padding runs through the kernels with its decay and write strength
set to zero (`g = 0`, `beta = 0`: the recurrent state passes it unchanged), and each node's conv
starts from the last valid inputs of its ancestor path (`bucketed_conv_tails`, a `varying` value of
the layout, which a CUDA graph's replay refills).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ps_bridge.layout import cumulative_offsets
from ps_bridge.tree.level_buckets import chunk_index, level_sequences


@dataclass
class GDNLevel:
    """One level of the tree as a varlen batch of compacted tokens `[start, end)`.

    cu / cu_host:       `[n + 1]` cumulative valid lengths of its sequences, from 0 (int64); no host
                        list (None) under level buckets.
    parent / parent_host: `[n]` index of each sequence's parent among the previous level's
                        sequences; None for the roots.
    has_children:       some sequence of this level is a parent (its final state is needed).
    fillers:            filler sequences after the level's nodes (level buckets), from zero states.
    chunk_index:        fla's chunk index of the sequences (level buckets), else None (fla's own).
    """

    start: int
    end: int
    cu: torch.Tensor
    cu_host: List[int]
    parent: Optional[torch.Tensor]
    parent_host: Optional[List[int]]
    has_children: bool
    fillers: int = 0
    chunk_index: Optional[torch.Tensor] = None

    @property
    def num_sequences(self) -> int:
        return self.cu.numel() - 1


@dataclass
class GDNPlan:
    """Index bookkeeping for one forward pass (built once per micro-batch, reused by every layer).

    gather_index:     `[L]` source positions (in the flattened input) of the compacted tokens, or
                      None when the input is already compact (no padding), so no copy is made.
    num_input_tokens: flattened input length (padding included).
    cu_all / cu_all_host: `[N + 1]` every node as one varlen batch (the compacted tokens in order):
                      the conv runs on it in one call (under level buckets with the fillers, no host
                      list, and `conv_chunk_index` its chunk index).
    parent_host:      `[N]` each node's parent (index among all nodes), -1 for a root.
    levels:           the levels, roots first (`GDNLevel`).
    """

    gather_index: Optional[torch.Tensor]
    num_input_tokens: int
    cu_all: torch.Tensor
    cu_all_host: List[int]
    parent_host: List[int]
    levels: List[GDNLevel]
    conv_chunk_index: Optional[torch.Tensor] = None
    _cache: Dict[tuple, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def depth(self) -> int:
        return len(self.levels) - 1

    @property
    def num_sequences(self) -> int:
        return self.cu_all.numel() - 1

    def conv_tail_index(self, width: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """For each node, the compacted positions of the last `width` inputs before it on its
        ancestor path (which may span several ancestors when they are shorter than `width`): an
        `[N * width]` index and an `[N, width]` mask, False before the sequence start (a root's
        tail is all False: zeros). Built from the host lists in time linear in nodes x width."""
        key = ("conv_tail", width, str(device))
        if key not in self._cache:
            cu = self.cu_all_host
            index, valid = conv_tails(cu[:-1], [b - a for a, b in zip(cu, cu[1:])], self.parent_host, width)
            self._cache[key] = (index.to(device), valid.to(device))
        return self._cache[key]


def conv_tails(starts: Sequence[int], lengths: Sequence[int], parent: Sequence[int], width: int):
    """`GDNPlan.conv_tail_index` for nodes whose valid inputs are `starts[s] .. starts[s] + lengths[s]`
    (parents before children): an `[N * width]` long index and an `[N, width]` bool mask, on the CPU."""
    tail_end: List[List[int]] = []  # the last `width` positions of the path through each node
    index: List[int] = []
    valid: List[bool] = []
    for s, p in enumerate(parent):
        before = tail_end[p] if p >= 0 else [-1] * width
        index.extend(max(i, 0) for i in before)
        valid.extend(i >= 0 for i in before)
        a, b = int(starts[s]), int(starts[s]) + int(lengths[s])
        tail_end.append((before + list(range(max(a, b - width), b)))[-width:])
    return torch.tensor(index, dtype=torch.long), torch.tensor(valid, dtype=torch.bool).view(-1, width)


def bucketed_conv_tails(layout, width: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The conv tails of a bucketed layout's nodes in its padded pack (the last `width` valid inputs of
    each node's ancestor path, `conv_tails`; under level buckets with a row of zeros per filler
    sequence) on `device`, registered as the layout's `varying` values."""

    def on_host(other):  # once per layout, for both of its tensors
        host = other.host

        def build():
            index, valid = conv_tails(host["cu_seqlens_padded"][:-1], host["valid_lengths"], host["segment_parent"], width)
            if not other.level_buckets:
                return index, valid
            index = index.view(-1, width)
            offsets, rows = host["level_offsets"], []
            for (lo, hi), lengths in zip(zip(offsets, offsets[1:]), level_sequences_of(other)):
                fillers = len(lengths) - (hi - lo)
                rows.append((index[lo:hi], valid[lo:hi]))
                rows.append((index.new_zeros(fillers, width), valid.new_zeros(fillers, width)))
            return torch.cat([i for i, _ in rows]).view(-1), torch.cat([v for _, v in rows])

        return other.derived(("gdn_conv_tails_host", width), build)

    def on_device():
        index, valid = (x.to(device) for x in on_host(layout))
        return (layout.varying(("gdn_conv_tail", width, str(device)), index, lambda other: on_host(other)[0]),
                layout.varying(("gdn_conv_mask", width, str(device)), valid, lambda other: on_host(other)[1]))

    return layout.derived(("gdn_bucketed_conv_tails", width, str(device)), on_device)


def parents(parent: Sequence[int]) -> List[bool]:
    """For each node (`parent[s]`: its parent, -1 for a root), whether it is some node's parent."""
    is_parent = [False] * len(parent)
    for p in parent:
        if p >= 0:
            is_parent[p] = True
    return is_parent


def level_sequences_of(layout) -> List[List[int]]:
    """Per level of a level-bucketed layout, the lengths of the sequences the GDN runs it as: its
    segments (each its own length, padded to the layout's `pad_multiple`) and then the fillers over the
    rest of the level's block (`tree.level_buckets.level_sequences`). From host lists, once per layout."""

    def build():
        host = layout.host
        offsets = host["level_offsets"]
        return [level_sequences(host["own_lengths"][lo:hi], block)
                for lo, hi, block in zip(offsets, offsets[1:], host["level_blocks"])]

    return layout.derived("gdn_level_sequences", build)


def _level_values(layout) -> Dict[object, torch.Tensor]:
    """The offsets and chunk indices of a level-bucketed layout's GDN calls, on the CPU: per level
    `("cu", d)` and `("chunks", d)`, and over all of them (the conv's one call) `"cu_all"` and
    `"conv_chunks"`."""

    def build():
        as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        values: Dict[object, torch.Tensor] = {}
        every: List[int] = []
        for d, lengths in enumerate(level_sequences_of(layout)):
            values[("cu", d)] = as_long(cumulative_offsets(lengths))
            values[("chunks", d)] = as_long(chunk_index(lengths)).view(-1, 2)
            every += lengths
        values["cu_all"] = as_long(cumulative_offsets(every))
        values["conv_chunks"] = as_long(chunk_index(every)).view(-1, 2)
        return values

    return layout.derived("gdn_level_values", build)


def level_plan(layout, device) -> GDNPlan:
    """The plan of a level-bucketed layout (module docstring): each level's block as its nodes and
    fillers, offsets and chunk indices as the layout's `varying` values on `device`."""
    host = layout.host
    offsets, parent = host["level_offsets"], host["segment_parent"]
    values = _level_values(layout)

    def on_device(key):
        return layout.varying(("gdn_level", key, str(device)), values[key].to(device),
                              lambda other: _level_values(other)[key])

    is_parent = parents(parent)
    levels, start = [], 0
    for d, (lengths, block) in enumerate(zip(level_sequences_of(layout), host["level_blocks"])):
        lo, hi = offsets[d], offsets[d + 1]
        parent_host = None if d == 0 else [parent[s] - offsets[d - 1] for s in range(lo, hi)]
        levels.append(GDNLevel(
            start=start, end=start + block, cu=on_device(("cu", d)), cu_host=None,
            parent=None if parent_host is None else torch.tensor(parent_host, dtype=torch.long, device=device),
            parent_host=parent_host, has_children=any(is_parent[lo:hi]), fillers=len(lengths) - (hi - lo),
            chunk_index=on_device(("chunks", d)),
        ))
        start += block
    return GDNPlan(gather_index=None, num_input_tokens=start, cu_all=on_device("cu_all"), cu_all_host=None,
                   parent_host=list(parent), levels=levels, conv_chunk_index=on_device("conv_chunks"))


def build_plan(
    starts: Sequence[int],
    valid_lengths: Sequence[int],
    parent: Sequence[int],
    level_offsets: Sequence[int],
    num_input_tokens: int,
    device,
) -> GDNPlan:
    """General form: segment `s` occupies input positions `starts[s] .. starts[s] + valid_lengths[s]`;
    segments come level by level (level d is `level_offsets[d]:level_offsets[d + 1]`) and a
    segment's parent (`parent[s]`, -1 for a root) is in the level before its own."""
    N = len(starts)
    if N == 0 or level_offsets[0] != 0 or level_offsets[-1] != N:
        raise ValueError(f"level_offsets {list(level_offsets)} do not cover the {N} sequences")
    cu_all = cumulative_offsets(valid_lengths)
    # contiguous and already in order: the compacted tokens are the input itself
    identity = all(int(a) == b for a, b in zip(starts, cu_all)) and cu_all[-1] == num_input_tokens
    gather_index = None
    if not identity:
        gather_index = torch.cat(
            [torch.arange(int(a), int(a) + int(n), dtype=torch.long) for a, n in zip(starts, valid_lengths)]
        ).to(device)
    is_parent = parents(parent)
    levels = []
    for d in range(len(level_offsets) - 1):
        lo, hi = level_offsets[d], level_offsets[d + 1]
        for s in range(lo, hi):
            p = parent[s]
            if (d == 0) != (p < 0) or (d > 0 and not level_offsets[d - 1] <= p < lo):
                raise ValueError(f"sequence {s} (level {d}) has parent {p}, which is not in the level before")
        cu = [c - cu_all[lo] for c in cu_all[lo : hi + 1]]
        parent_host = None if d == 0 else [parent[s] - level_offsets[d - 1] for s in range(lo, hi)]
        levels.append(GDNLevel(
            start=cu_all[lo],
            end=cu_all[hi],
            cu=torch.tensor(cu, dtype=torch.long, device=device),
            cu_host=cu,
            parent=None if parent_host is None else torch.tensor(parent_host, dtype=torch.long, device=device),
            parent_host=parent_host,
            has_children=any(is_parent[lo:hi]),
        ))
    return GDNPlan(
        gather_index=gather_index,
        num_input_tokens=int(num_input_tokens),
        cu_all=torch.tensor(cu_all, dtype=torch.long, device=device),
        cu_all_host=cu_all,
        parent_host=list(parent),
        levels=levels,
    )


def plan_from_layout(layout, device=None) -> GDNPlan:
    """The plan of a packed prefix layout, built once per device and reused by every GDN layer of
    a forward pass (`layout.derived`)."""
    device = torch.device(device) if device is not None else layout.device
    host = layout.host
    if layout.level_buckets:
        return layout.derived(("gdn_plan", str(device)), lambda: level_plan(layout, device))
    return layout.derived(
        ("gdn_plan", str(device)),
        lambda: build_plan(
            starts=host["cu_seqlens_padded"][:-1],
            valid_lengths=host["padded_lengths" if layout.bucketed else "valid_lengths"],
            parent=host["segment_parent"],
            level_offsets=host["level_offsets"],
            num_input_tokens=host["cu_seqlens_padded"][-1],
            device=device,
        ),
    )
