"""Level buckets: one fixed shape per tree level, whatever the lengths of its segments.

A CUDA graph replays the kernels it captured with their grids. The varlen kernels size their grids
by host integers: flash attention by the batch size and the longest sequence it is told, fla-core's
`chunk_gated_delta_rule` and `causal_conv1d` by the sequence count (`len(cu_seqlens) - 1`) and the
chunk count (`len(chunk_indices)`, `CHUNK`-token chunks per sequence). Under level buckets a tree
level's segments keep their own lengths, and the level's block of the pack is padded to a bucket
(`level_block_length`); the Gated DeltaNet runs the level as its segments followed by `filler_count`
filler sequences over the padding, whose lengths (zero allowed) make the chunk count
`chunks(block) + segments` (`level_sequences`). The sequence and chunk counts then follow the tree's
shape and the block lengths only, and the offsets (`cu_seqlens`, `chunk_indices`) are device values
a replay refills. The attention's causal call takes each level's padding as `PADDING_PIECES` elements
of its own and is bounded by `segment_bound`. A pack takes the blocks of a recent pack of its tree
shape where they hold it with little more padding (`RecentShapes`), so that packs of nearby totals
share one structure.

Why those counts always fit: `m` non-empty fillers of `c_j` chunks hold between `64 c_j - 63` and
`64 c_j` tokens each; the real segments take at most one partial chunk each beyond `chunks(real
tokens)`, so the fillers are left between `padding / 64` and `padding` chunks, and
`segments + 2 + segments // 63` fillers hold any such split (`filler_lengths`; checked over random
and extreme batches in tests/test_level_buckets.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable, List, Sequence, Tuple

CHUNK = 64  # fla's chunk size for the delta rule and the varlen conv
# the attention's causal call over every segment takes a level's padding as this many elements of their
# own, so that its longest element, which sizes the kernel's grid, stays near the longest segment
PADDING_PIECES = 8
RECENT = 8  # block choices remembered per tree shape
TREE_SHAPES = 16  # tree shapes remembered


def chunks(length: int) -> int:
    return -(-int(length) // CHUNK)


def filler_count(segments: int) -> int:
    """The filler sequences a level of `segments` segments is run with."""
    return segments + 2 + segments // 63


def level_bucket(n: int) -> int:
    """`n` rounded up to a multiple of 64 below 1024, and from there to a multiple of an eighth of the
    largest power of two not above `n` (1024, 1152, ..., 2048, 2304, ...): at most an eighth of a
    level's block is padding, and blocks of nearby totals recur."""
    step = max(CHUNK, 1 << max(int(n).bit_length() - 4, 0))
    return -(-int(n) // step) * step


def largest_block(real_tokens: int, segments: int) -> int:
    """The largest block `level_bucket` gives a level of `real_tokens` tokens in `segments` segments
    for any split of them: the tokens and the fillers' room, plus 63 tokens below 1024, an eighth above."""
    n = int(real_tokens) + filler_count(segments)
    return n + max(CHUNK - 1, n // 8)


def level_block_length(real_tokens: int, segments: int, multiple: int = 1) -> int:
    """The block of a level whose `segments` segments hold `real_tokens` tokens: room for the
    fillers' tokens too (each non-empty filler holds one at least), bucketed, a multiple of `multiple`."""
    block = level_bucket(real_tokens + filler_count(segments))
    return -(-block // multiple) * multiple


def filler_lengths(padding: int, chunk_count: int, fillers: int) -> List[int]:
    """`fillers` lengths (zero allowed) summing to `padding` tokens and `chunk_count` chunks: the
    fewest non-empty fillers that hold them, the first taking the chunks beyond one each, the tokens
    spread from each filler's least."""
    if chunk_count == 0:
        if padding:
            raise ValueError(f"{padding} padding tokens in no chunk")
        return [0] * fillers
    m = max(1, -(-(CHUNK * chunk_count - padding) // (CHUNK - 1)))
    if padding > CHUNK * chunk_count or m > min(fillers, chunk_count, padding):
        raise ValueError(f"no {fillers} fillers hold {padding} tokens in {chunk_count} chunks")
    counts = [chunk_count - (m - 1)] + [1] * (m - 1)
    lengths = [CHUNK * (c - 1) + 1 for c in counts]
    extra = padding - sum(lengths)
    for j in range(m):
        add = min(extra, CHUNK - 1)
        lengths[j] += add
        extra -= add
    return lengths + [0] * (fillers - m)


def level_sequences(lengths: Sequence[int], block: int) -> List[int]:
    """The sequences a level of segments `lengths` in a block of `block` tokens is run as: the
    segments, then `filler_count` fillers over the rest of the block, `chunks(block) + len(lengths)`
    chunks in all."""
    s = len(lengths)
    real = sum(int(n) for n in lengths)
    fillers = filler_count(s)
    if real + fillers > block:
        raise ValueError(f"a block of {block} tokens holds no {s} segments of {real} tokens and {fillers} fillers")
    want = chunks(block) + s - sum(chunks(n) for n in lengths)
    return [int(n) for n in lengths] + filler_lengths(block - real, want, fillers)


def padding_pieces(start: int, end: int) -> List[int]:
    """The ends of the `PADDING_PIECES` near-equal pieces (empty ones allowed) of a level's padding
    `[start, end)`."""
    return [start + (end - start) * j // PADDING_PIECES for j in range(1, PADDING_PIECES + 1)]


def segment_bound(own_by_level: Sequence[Sequence[int]], blocks: Sequence[int]) -> int:
    """The attention's bound on its causal call's longest element (a segment, or a piece of a level's
    padding: `padding_pieces`), a power of two (at least 16) so that nearby packs share it."""
    pieces = max(-(-(block - sum(own)) // PADDING_PIECES) for own, block in zip(own_by_level, blocks))
    longest = max(max(max(own, default=0) for own in own_by_level), pieces, 16)
    return 1 << (longest - 1).bit_length()


@dataclass(frozen=True)
class LevelShape:
    """What the shapes of a level-bucketed pack follow besides its tree: each level's block (the last
    one holding the pack's own padding to its multiple) and the attention's bound (`segment_bound`)."""

    blocks: Tuple[int, ...]
    bound: int


def own_shape(own_by_level: Sequence[Sequence[int]], multiple: int = 1, total_multiple: int = 1) -> LevelShape:
    """The level shape of segments `own_by_level` (each padded to `multiple`) with no other pack in view."""
    blocks = [level_block_length(sum(own), len(own), multiple) for own in own_by_level]
    blocks[-1] += -(-sum(blocks) // total_multiple) * total_multiple - sum(blocks)
    return LevelShape(tuple(blocks), segment_bound(own_by_level, blocks))


class RecentShapes:
    """The level shapes recently chosen per tree shape. `choose` gives a pack the smallest recent shape of
    its tree shape whose blocks hold its segments in no more tokens than its own blocks could have
    (`largest_block` per level, or its own shape's where that is larger) and whose bound holds its
    longest element, else its own shape (then remembered): packs of nearby totals then share a
    structure and replay one CUDA graph (`ps_bridge.cuda_graphs`), and no pack holds more padding
    than bucketing alone may give it (at most an eighth of a level above 1024 tokens). A bound of 1/8
    above the pack's own (already rounded) blocks would let a recent shape hold every smaller pack
    rounded up twice, with up to a quarter of padding, for as long as it stayed recent. A pack asked about twice gets
    the same answer (its own shape, once remembered, fits it)."""

    def __init__(self, recent: int = RECENT, tree_shapes: int = TREE_SHAPES):
        self.recent, self.tree_shapes = recent, tree_shapes
        self._shapes: "OrderedDict[Hashable, deque]" = OrderedDict()

    def choose(self, tree_shape: Hashable, own_by_level: Sequence[Sequence[int]], multiple: int = 1,
               total_multiple: int = 1) -> LevelShape:
        mine = own_shape(own_by_level, multiple, total_multiple)
        shapes = self._shapes.get(tree_shape)
        if shapes is None:
            shapes = self._shapes[tree_shape] = deque(maxlen=self.recent)
            while len(self._shapes) > self.tree_shapes:
                self._shapes.popitem(last=False)
        self._shapes.move_to_end(tree_shape)
        most = max(sum(mine.blocks), sum(largest_block(sum(own), len(own)) for own in own_by_level))
        fits = [shape for shape in shapes
                if all(b >= n for b, n in zip(shape.blocks, mine.blocks))
                and sum(shape.blocks) <= most
                and segment_bound(own_by_level, shape.blocks) <= shape.bound]
        if fits:
            return min(fits, key=lambda shape: sum(shape.blocks))
        shapes.append(mine)
        return mine

    def clear(self) -> None:
        self._shapes.clear()


# the process's recent shapes (every model of the process: the actor's and reference's packs alike)
RECENT_SHAPES = RecentShapes()


def chunk_index(lengths: Sequence[int]) -> List[List[int]]:
    """fla's `chunk_indices` of sequences `lengths`: (sequence, chunk within it) per chunk, in order."""
    return [[s, c] for s, n in enumerate(lengths) for c in range(chunks(n))]
