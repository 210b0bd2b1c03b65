"""The packed layout's type: `PackedPrefixLayout` (the tensors a prefix-aware model runs one packed
micro-batch with, and the way back to per-sample rows), the `Sample` it is built from, and
`cumulative_offsets`. `ps_bridge.layout` builds it (decide, order, materialize: `ps_bridge.tree`) and
re-exports these names; this module imports nothing of the package, so the building steps can
import the type without a cycle."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable, Hashable, Iterable, List, Optional, TypeVar

import torch

from ps_bridge.transfer import to_device

T = TypeVar("T")


def cumulative_offsets(lengths: Iterable[int]) -> List[int]:
    """`[0, l0, l0 + l1, ...]`: the cu_seqlens form of a list of lengths."""
    return list(accumulate((int(n) for n in lengths), initial=0))


@dataclass
class Sample:
    prompt: List[int]
    response: List[int]
    uid: Optional[str] = None
    # the images behind the sequence's image placeholder runs (`ps_bridge.images.ImageSpan`s, in order;
    # `images.attach_images` places them): sharing compares them, the model runs them
    images: Optional[tuple] = None


# what `structure_key` leaves out: the token ids and their labels (what a CUDA graph's replay takes
# new values of), the host copies (derived from the tensors) and the images (refused by the graphs)
_NOT_STRUCTURE = frozenset({"tokens", "row_label", "host", "images"})
# what it also leaves out of a bucketed layout: the values that follow the segments' lengths inside
# their buckets. A replay refills those the forward reads (`BUCKET_INPUTS` and the `varying` values);
# the others (the rows, the counts) serve the rows, which are taken from the caller's layout
_BUCKET_VARYING = frozenset({
    "positions", "valid", "valid_lengths", "cu_seqlens", "sample_prompt_length", "sample_response_length",
    "row_offsets", "row_source", "tokens_unshared", "tokens_shared", "output_positions", "output_keep",
})
# and what it also leaves out under level buckets, where the segments keep their own lengths inside
# their level's block (`ps_bridge.tree.level_buckets`): the segment offsets and the per-token segment
# and group ids. The forward reads the offsets through `varying` values only; the block lengths and
# the attention's longest element, which the shapes and grids follow, are in the key
# (`host["level_blocks"]`, `host["segment_bound"]`)
_LEVEL_VARYING = frozenset({"padded_lengths", "cu_seqlens_padded", "segment_ids", "group_ids"})
# the tensors of a bucketed layout that its forward reads and a replay refills (`output_positions`:
# the read positions, their count bucketed, where the layout lists them)
BUCKET_INPUTS = ("tokens", "positions", "valid", "output_positions")


@dataclass
class PackedPrefixLayout:
    """Everything a prefix-aware model needs to run one packed micro-batch, plus the way back.

    Per token (length T, padding included):
      tokens, positions, segment_ids (PAD tokens carry their segment's id), group_ids,
      is_prompt (token belongs to a prompt segment), valid (not padding).
    Per segment (length S, prompt segments first, in group order, then response segments):
      segment_group, segment_is_prompt, valid_lengths, padded_lengths,
      cu_seqlens (cumulative valid lengths), cu_seqlens_padded (segment offsets in the pack).
    Per group (length G): group_size (group g's prompt is segment g).
    Per sample (length B, input order): sample_group, sample_segment (its response segment, or its
      whole segment when unshared), sample_prompt_length, sample_response_length.
    Inverse map (flattened rows, length sum(P_i + R_i)): row_offsets [B+1], row_source (packed
      position read), row_label (label, or -1 for the last row position).
    Read positions: output_positions, sorted packed positions the output layer runs on (each
      response position and each prompt's last position), or None for every position (see the
      module docstring).
    The tree (segments are its nodes, in pack order): segment_parent, segment_level, segment_tin,
      segment_tout, and in `host` level_offsets and depth. A *group* is a root's subtree, a
      *prompt* segment a root (level 0); sample_segment is the node holding a sample's last token.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    segment_ids: torch.Tensor
    group_ids: torch.Tensor
    is_prompt: torch.Tensor
    valid: torch.Tensor
    segment_group: torch.Tensor
    segment_is_prompt: torch.Tensor
    valid_lengths: torch.Tensor
    padded_lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    group_size: torch.Tensor
    sample_group: torch.Tensor
    sample_segment: torch.Tensor
    sample_prompt_length: torch.Tensor
    sample_response_length: torch.Tensor
    row_offsets: torch.Tensor
    row_source: torch.Tensor
    row_label: torch.Tensor
    shared: bool
    pad_multiple: int
    num_prompt_segments: int
    tokens_unshared: int
    tokens_shared: int
    # every segment of a level padded to the level's bucket length (`tree.materialize.bucket_length`)
    bucketed: bool = False
    # with `bucketed`: the segments keep their own lengths and each level's block is padded to a
    # bucket instead (`ps_bridge.tree.level_buckets`)
    level_buckets: bool = False
    # host copies of small per-segment metadata, so kernels need no device->host sync
    host: dict = field(default_factory=dict, repr=False)
    # the model's true vocabulary when the layout was built for one (token ids are checked against
    # it, and the row extractor keeps a padded vocabulary's extra ids out of the log-probs)
    vocab_size: Optional[int] = None
    output_positions: Optional[torch.Tensor] = None
    # a bucketed layout's: the indices of `output_positions` that rows read (the others are a bucket's
    # padding and prompt tokens before a fork, listed so that their count follows the structure): the
    # model gathers the final hidden states at `output_positions` (a CUDA graph's fixed count), and the
    # output layer runs on these of them only (`logit_positions`)
    output_keep: Optional[torch.Tensor] = None
    # the tree, per segment (= node, in pack order): parent segment (-1 for a root), level (depth),
    # depth-first interval [tin, tout) (segment a is an ancestor of s or s itself iff
    # tin[a] <= tin[s] < tout[a])
    segment_parent: Optional[torch.Tensor] = None
    segment_level: Optional[torch.Tensor] = None
    segment_tin: Optional[torch.Tensor] = None
    segment_tout: Optional[torch.Tensor] = None
    # the images of the pack (`ps_bridge.images.PackedImages`: the vision tower's inputs, where their
    # embeddings go, every token's mRoPE position); None for text-only samples
    images: Optional[object] = None

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_segments(self) -> int:
        return int(self.valid_lengths.numel())

    @property
    def num_groups(self) -> int:
        return int(self.group_size.numel())

    @property
    def num_samples(self) -> int:
        return int(self.sample_group.numel())

    @property
    def has_sharing(self) -> bool:
        """True when at least one position is read by two or more samples (a prompt stored once for
        two or more responses; in a tree, any shared node, which implies a shared root)."""
        return self.shared and bool((self.group_size > 1).any())

    @property
    def tree_depth(self) -> int:
        """Depth of the prefix tree: 0 when every segment is a root (unshared), 1 for one level of
        sharing (prompts and their responses), more for a deeper tree (`share="tree"`)."""
        return self.host["depth"]

    @property
    def level_offsets(self) -> List[int]:
        """Cumulative segment counts per tree level (`[0, roots, roots + level 1, ...]`): the
        segments of level d are `level_offsets[d]:level_offsets[d + 1]`, contiguous in the pack."""
        return self.host["level_offsets"]

    def token_intervals(self):
        """Per token `(tin, tout)` of its segment (on the layout's device, cached): key k is in an
        ancestor segment of query q, or in q's own, iff `tin[k] <= tin[q] < tout[k]`."""
        return self.derived(
            ("token_intervals", str(self.device)),
            lambda: (self.segment_tin.to(self.device)[self.segment_ids], self.segment_tout.to(self.device)[self.segment_ids]),
        )

    @property
    def prompt_block_end(self) -> int:
        """Packed offset where the response block starts."""
        return int(self.host["cu_seqlens_padded"][self.num_prompt_segments])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def derived(self, key: Hashable, build: Callable[[], T]) -> T:
        """A value derived from this layout (a kernel plan, per-token weights), built on first use
        and then shared by every layer of the forward and backward, and by `.to(device)` copies,
        which share `host`. `key` names the value, including the device when it holds tensors."""
        cache = self.host.setdefault("derived", {})
        if key not in cache:
            cache[key] = build()
        return cache[key]

    def varying(self, key: Hashable, static: torch.Tensor, build: Callable[["PackedPrefixLayout"], torch.Tensor]) -> torch.Tensor:
        """Registers `static`, a device tensor a kernel reads that holds `build(self)`: values of a
        bucketed layout's segment lengths in a shape of its structure (an attention call's key
        offsets, the conv tails of Gated DeltaNet). A CUDA graph captured on this layout reads
        `static`; a replay for another layout `L` of the same structure copies `build(L)` into it
        (`cuda_graphs`). `build` reads only the layout it is given. Returns `static`."""
        self.host.setdefault("varying", {}).setdefault(key, (build, static))
        return static

    def host_lengths(self, name: str) -> List[int]:
        """A per-sample tensor field (`sample_prompt_length`, ...) as a host list, read once."""
        return self.derived(("host", name), lambda: getattr(self, name).tolist())

    def structure_key(self) -> str:
        """A digest of everything in the layout but its token ids and labels: two layouts with the same
        key hold equal values in every other tensor and field, so every device tensor a forward derives
        from them (positions, segment offsets, the attention and GDN plans, the read positions) is the
        same (`ps_bridge.cuda_graphs`). A bucketed layout's key leaves out what follows the segments'
        lengths inside their buckets too (under level buckets, inside their level's block): two bucketed
        layouts with the same key have the same tree, the same buckets and so the same shapes, and their
        forwards differ only in `BUCKET_INPUTS` and the `varying` values. Read from the CPU tensors the layout was moved from, so a layout on the GPU
        is not read back."""

        def build() -> str:
            source = self.host.get("cpu_layout", self)
            digest = hashlib.blake2b(digest_size=16)
            left_out = _NOT_STRUCTURE | _BUCKET_VARYING if self.bucketed else _NOT_STRUCTURE
            if self.bucketed:  # the read positions follow the lengths; their kinds and count are structure
                outputs = source.output_positions
                digest.update(f"outputs={None if outputs is None else outputs.numel()};".encode())
                digest.update(f"read_kinds={source.host.get('read_kinds')!r};".encode())
            if self.level_buckets:
                left_out = left_out | _LEVEL_VARYING
                digest.update(f"level_blocks={source.host['level_blocks']!r};".encode())
                digest.update(f"segment_bound={source.host['segment_bound']!r};".encode())
            for name, value in sorted(vars(source).items()):
                if name in left_out:
                    continue
                if isinstance(value, torch.Tensor):
                    value = value.detach().cpu().contiguous()
                    digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}:".encode())
                    digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
                else:
                    digest.update(f"{name}={value!r};".encode())
            return digest.hexdigest()

        return self.derived("structure_key", build)

    def to(self, device) -> "PackedPrefixLayout":
        """Move the tensors to `device`; host copies stay on the CPU. The rows' offsets (`PackedRows`)
        are read to the host first where they are still there: read back from the device, they would
        make the host wait for the GPU's queued work. The CPU layout stays reachable from the shared
        `host` (`structure_key` reads it)."""
        if self.row_offsets.device.type == "cpu":
            self.host_lengths("row_offsets")
            self.host.setdefault("cpu_layout", self)
        moved = {}
        for name, value in self.__dict__.items():
            moved[name] = to_device(value, device) if isinstance(value, torch.Tensor) else value
        if self.images is not None:
            moved["images"] = self.images.to(device)
        return PackedPrefixLayout(**moved)

    def cp_shard(self, cp_rank: int, cp_size: int) -> slice:
        """The packed positions context-parallel rank `cp_rank` of `cp_size` holds: one contiguous,
        equal shard (the layout was built with `total_multiple` a multiple of `cp_size`)."""
        T = self.num_tokens
        if T % cp_size:
            raise ValueError(
                f"the packed sequence has {T} tokens, not divisible by context_parallel_size={cp_size}: "
                "build the layout with total_multiple a multiple of the CP size (runtime.make_layout does)"
            )
        size = T // cp_size
        return slice(cp_rank * size, (cp_rank + 1) * size)

    def local_output_positions(self, cp_shard: Optional[slice] = None) -> Optional[torch.Tensor]:
        """The positions of this rank's tokens (its CP shard, offsets local to it; all without CP) at
        which the model runs its output layer, sorted, on the layout's device; None: every position.
        A CP shard that holds no read position gets its first position, so that the output layer
        never runs on zero rows (the rows read nothing from it: `output_mask`)."""
        if self.output_positions is None:
            return None
        key = ("local_output_positions", str(self.device), None if cp_shard is None else (cp_shard.start, cp_shard.stop))

        def build():
            positions = to_device(self.output_positions, self.device)
            if cp_shard is None:
                return positions
            inside = positions[(positions >= cp_shard.start) & (positions < cp_shard.stop)] - cp_shard.start
            return inside if inside.numel() else positions.new_zeros(1)

        return self.derived(key, build)

    def logit_positions(self, cp_shard: Optional[slice] = None) -> Optional[torch.Tensor]:
        """The positions the output layer runs on, whose values the logits hold in order: the
        `local_output_positions`, of a bucketed layout those rows read (`output_keep`); None: every
        position."""
        positions = self.local_output_positions(cp_shard)
        if positions is None or self.output_keep is None:
            return positions
        if cp_shard is not None:
            raise ValueError("a bucketed layout (CUDA graphs) runs without context parallelism")
        return self.derived(("logit_positions", str(self.device)),
                            lambda: positions.index_select(0, to_device(self.output_keep, self.device)))

    def output_mask(self) -> Optional[torch.Tensor]:
        """`[T]` bool on the layout's device: True at the positions whose values rows read
        (`logit_positions`); None when every position is computed."""
        if self.output_positions is None:
            return None

        def build():
            mask = torch.zeros(self.num_tokens, dtype=torch.bool, device=self.device)
            mask.index_fill_(0, self.logit_positions(), True)
            return mask

        return self.derived(("output_mask", str(self.device)), build)

    def describe(self) -> str:
        valid = self.host["valid_lengths"]
        padded = self.host["padded_lengths"]
        return (
            f"valid_lengths={valid}, padded_lengths={padded}, "
            f"cu_seqlens={self.host['cu_seqlens_padded']}, groups={self.num_groups}, "
            f"samples={self.num_samples}, tokens_unshared={self.tokens_unshared}, "
            f"tokens_shared={self.tokens_shared}, depth={self.tree_depth}, nodes={self.num_segments}, "
            f"trie_tokens={self.tokens_shared}"
            + ("" if self.images is None else f", {self.images.describe()}")
        )
