"""The packed prefix-shared layout of one micro-batch.

A micro-batch is a list of samples `(prompt, response)`. Samples whose prompt tokens are identical
form a *group*; each group's prompt is stored once. The packed THD sequence is

    [prompt_1][prompt_2]...[prompt_G] [r_1,1][r_1,2]...[r_1,n1] [r_2,1]...        (+ padding)
    '------- prompt block --------'   '------------- response block ------------'

Each prompt and each response is one *segment* (one THD sequence in `cu_seqlens`), padded at its
end to a multiple of `pad_multiple`; the last segment is padded further so that the whole pack is a
multiple of `total_multiple` (context parallelism cuts the pack into equal contiguous shards,
`cp_shard`). Keeping all prompts before all responses makes both blocks
contiguous: a kernel can treat "all prompts" and "all responses of all groups" as two varlen
batches without gathering (the cascade attention and the two Gated DeltaNet calls rely on this).

Token `t` of response i of a group with prompt length P sits at position `P + t` (RoPE continues
after the prompt). A response token attends to every valid token of its group's prompt and to the
earlier tokens of its own response; a prompt token attends causally inside its prompt.

The inverse map restores verl's row per sample, of length `P_i + R_i`: row position `t` holds
`log p(x[t+1] | x[:t+1])` of the sample's own sequence `x = prompt + response`, read from the packed
position of token `t`. Row position `P_i - 1` therefore reads the *shared* last prompt position with
this sample's own label `r_i[0]`; the last row position has no label and holds 0.

With `share=False` every sample is its own segment `[prompt + response]`: the unshared computation,
used as the reference and as the fallback.

Prefix trees. The layout above is the depth-one case of a prefix tree; `share="tree"` shares every
common prefix (a system prompt across prompts, a sample that is a prefix of another's): one segment
per node of a token radix tree, packed level by level (roots, then their children, ...), each token
at its position in its own sequence, each node attending to its ancestors' tokens (docs/tree.md).
The layout is built in three steps, each testable alone: decide what is shared
(`ps_bridge.tree.decide`), order the pack (`ps_bridge.tree.order`), materialize the tensors and the
way back (`ps_bridge.tree.materialize`); `build_layout` runs the three for every `share` mode.

Read positions. verl's losses read a row only from position `P_i - 1` on (the response log-probs,
entropies, ...). A shared layout built with `prompt_values=False` (what a `PrefixSharingConfig`
gives by default: `runtime.make_layout`, the verl engine) lists in `output_positions` the packed
positions those row positions read: every response position and each prompt's last position. The
model runs its output layer on these positions only (`PrefixSharedGPTModel`, through
`PrefixSharedPackedSeqParams.output_positions`), and the row extractor (`ps_bridge.rows`) leaves 0
in the rows of the other prompt positions. `output_positions` is None (every position computed)
for `prompt_values=True` and for unshared layouts (the stock computation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Callable, Hashable, Iterable, List, Optional, Sequence, TypeVar, Union

import numpy as np
import torch

from ps_bridge.tree.decide import PrefixTree, prompt_tree, token_trie, unshared_tree
from ps_bridge.tree.materialize import materialize
from ps_bridge.tree.order import pack_order

logger = logging.getLogger("ps_bridge")

PAD_SEGMENT = -1

# the shortest common run a "tree" layout shares by default (shorter runs are computed per sample);
# a guess, not measured: the issue bounds it by 64
DEFAULT_MIN_SHARED = 16

T = TypeVar("T")


def cumulative_offsets(lengths: Iterable[int]) -> List[int]:
    """`[0, l0, l0 + l1, ...]`: the cu_seqlens form of a list of lengths."""
    return list(accumulate((int(n) for n in lengths), initial=0))


@dataclass
class Sample:
    prompt: List[int]
    response: List[int]
    uid: Optional[str] = None


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
    # host copies of small per-segment metadata, so kernels need no device->host sync
    host: dict = field(default_factory=dict, repr=False)
    # the model's true vocabulary when the layout was built for one (token ids are checked against
    # it, and the row extractor keeps a padded vocabulary's extra ids out of the log-probs)
    vocab_size: Optional[int] = None
    output_positions: Optional[torch.Tensor] = None
    # the tree, per segment (= node, in pack order): parent segment (-1 for a root), level (depth),
    # depth-first interval [tin, tout) (segment a is an ancestor of s or s itself iff
    # tin[a] <= tin[s] < tout[a])
    segment_parent: Optional[torch.Tensor] = None
    segment_level: Optional[torch.Tensor] = None
    segment_tin: Optional[torch.Tensor] = None
    segment_tout: Optional[torch.Tensor] = None

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

    def host_lengths(self, name: str) -> List[int]:
        """A per-sample tensor field (`sample_prompt_length`, ...) as a host list, read once."""
        return self.derived(("host", name), lambda: getattr(self, name).tolist())

    def to(self, device) -> "PackedPrefixLayout":
        """Move the tensors to `device`; host copies stay on the CPU."""
        moved = {}
        for name, value in self.__dict__.items():
            moved[name] = value.to(device) if isinstance(value, torch.Tensor) else value
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
            positions = self.output_positions.to(self.device)
            if cp_shard is None:
                return positions
            inside = positions[(positions >= cp_shard.start) & (positions < cp_shard.stop)] - cp_shard.start
            return inside if inside.numel() else positions.new_zeros(1)

        return self.derived(key, build)

    def output_mask(self) -> Optional[torch.Tensor]:
        """`[T]` bool on the layout's device: True at the positions whose values rows read
        (`output_positions`); None when every position is computed."""
        if self.output_positions is None:
            return None

        def build():
            mask = torch.zeros(self.num_tokens, dtype=torch.bool, device=self.device)
            mask[self.output_positions.to(self.device)] = True
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
        )


# ---- building: decide what is shared, order the pack, materialize ---------------------------

SHARE_MODES = ("prompt", "tree")


def _flatten(samples: Sequence[Sample], vocab_size: Optional[int]):
    """Every sample's `prompt + response` as one int64 array, its offsets and prompt lengths,
    checked without a Python loop over the tokens."""
    if len(samples) == 0:
        raise ValueError("the micro-batch is empty: at least one sample is needed")
    for i, s in enumerate(samples):
        if len(s.prompt) == 0:
            raise ValueError(f"sample {i}: the prompt is empty (a prompt needs at least one token)")
        if len(s.response) == 0:
            raise ValueError(f"sample {i}: the response is empty (a response needs at least one token)")
        for part, ids in (("prompt", s.prompt), ("response", s.response)):
            if not set(map(type, ids)) <= {int}:
                t = next(t for t in ids if type(t) is not int)
                raise ValueError(f"sample {i}: {part} token {t!r} is not an integer")
    prompt_lengths, offsets = _sample_lengths(samples)
    flat = np.fromiter(chain.from_iterable(chain(s.prompt, s.response) for s in samples), dtype=np.int64, count=int(offsets[-1]))
    _check_ids(flat, offsets, prompt_lengths, vocab_size)
    return flat, offsets, prompt_lengths


def _sample_lengths(samples: Sequence[Sample]):
    """Prompt lengths `[B]` and the offsets `[B + 1]` of the samples' `prompt + response` sequences."""
    prompt_lengths = np.fromiter((len(s.prompt) for s in samples), dtype=np.int64, count=len(samples))
    lengths = prompt_lengths + np.fromiter((len(s.response) for s in samples), dtype=np.int64, count=len(samples))
    return prompt_lengths, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _check_ids(flat: np.ndarray, offsets: np.ndarray, prompt_lengths: np.ndarray, vocab_size: Optional[int]) -> None:
    bad = (flat < 0) if vocab_size is None else ((flat < 0) | (flat >= vocab_size))
    if bad.any():
        k = int(np.argmax(bad))
        i = int(np.searchsorted(offsets, k, side="right")) - 1
        part = "prompt" if k - offsets[i] < prompt_lengths[i] else "response"
        raise ValueError(
            f"sample {i}: {part} token id {int(flat[k])} is out of the vocabulary [0, {vocab_size})"
            if vocab_size is not None
            else f"sample {i}: {part} token id {int(flat[k])} is negative"
        )


def find_groups(samples: Sequence[Sample], classes: Optional[Sequence[Hashable]] = None) -> List[List[int]]:
    """Group sample indices by identical prompt tokens (and equal `classes`, when given), in order of
    first appearance.

    A `uid` never decides: two samples with equal uid but different prompts are different groups
    (verl's uid marks a prompt, but after truncation or templating the tokens are what count).
    """
    by_prompt: dict = {}
    groups: List[List[int]] = []
    for i, s in enumerate(samples):
        key = tuple(s.prompt) if classes is None else (classes[i], tuple(s.prompt))
        if key not in by_prompt:
            by_prompt[key] = len(groups)
            groups.append([])
        groups[by_prompt[key]].append(i)
    uid_prompts: dict = {}
    for s in samples:
        if s.uid is not None:
            uid_prompts.setdefault(s.uid, set()).add(tuple(s.prompt))
    for uid, prompts in uid_prompts.items():
        if len(prompts) > 1:
            logger.warning("[PS][prepare] uid %r carries %d different prompts; grouped by tokens", uid, len(prompts))
    return groups


def decide_sharing(
    samples: Sequence[Sample],
    flat: np.ndarray,
    offsets: np.ndarray,
    prompt_lengths: np.ndarray,
    share: Union[bool, str],
    *,
    min_shared: Optional[int] = None,
    max_depth: Optional[int] = None,
    share_classes: Optional[Sequence[Hashable]] = None,
) -> PrefixTree:
    """Step 1: the prefix tree. `share`: False (nothing), True or "prompt" (identical prompts, one
    level), "tree" (the token radix tree; `min_shared` default `DEFAULT_MIN_SHARED`)."""
    lengths = np.diff(offsets)
    if share is False:
        return unshared_tree(lengths)
    if share is True or share == "prompt":
        groups = find_groups(samples, share_classes)
        return prompt_tree(groups, prompt_lengths.tolist(), lengths.tolist())
    if share == "tree":
        return token_trie(
            flat, offsets, classes=share_classes, max_depth=max_depth,
            min_shared=DEFAULT_MIN_SHARED if min_shared is None else min_shared,
        )
    raise ValueError(f"share must be True, False, 'prompt' or 'tree', got {share!r}")


def decide_tree(
    samples: Sequence[Sample],
    share: Union[bool, str] = "tree",
    *,
    vocab_size: Optional[int] = None,
    min_shared: Optional[int] = None,
    max_depth: Optional[int] = None,
    share_classes: Optional[Sequence[Hashable]] = None,
) -> PrefixTree:
    """Step 1 alone, from the samples (ids checked as `build_layout` checks them): the prefix tree
    `build_layout` would pack. Built once, it serves both the sharing rule's counts
    (`launch_rule.sharing_for(..., tree=...)`) and the layout (`build_layout(..., tree=...)`)."""
    samples = [s if isinstance(s, Sample) else Sample(*s) for s in samples]
    flat, offsets, prompt_lengths = _flatten(samples, vocab_size)
    _check_share_classes(share_classes, len(samples))
    tree = decide_sharing(
        samples, flat, offsets, prompt_lengths, share,
        min_shared=min_shared, max_depth=max_depth, share_classes=share_classes,
    )
    tree.sequences = (flat, offsets, prompt_lengths)  # build_layout(tree=...) packs these, not flattened again
    return tree


def _check_share_classes(share_classes, num_samples: int) -> None:
    if share_classes is not None and len(share_classes) != num_samples:
        raise ValueError(f"share_classes has {len(share_classes)} entries for {num_samples} samples")


def _given_tree_sequences(samples: Sequence[Sample], tree: PrefixTree, vocab_size: Optional[int]):
    """The flattened sequences of a tree handed to `build_layout`, which must be these samples': the
    same count and lengths, every node inside its sequence (the tokens are not compared again: decide
    the tree with `decide_tree`, which keeps them, from the same samples)."""
    if tree.num_samples != len(samples):
        raise ValueError(
            f"the prefix tree given to build_layout has {tree.num_samples} samples, the micro-batch {len(samples)}: "
            "decide it from the same samples (layout.decide_tree)"
        )
    if tree.sequences is None:
        flat, offsets, prompt_lengths = _flatten(samples, vocab_size)
    else:
        flat, offsets, prompt_lengths = tree.sequences
        given_prompts, given_offsets = _sample_lengths(samples)
        if not (np.array_equal(given_prompts, prompt_lengths) and np.array_equal(given_offsets, offsets)):
            raise ValueError("the prefix tree given to build_layout was decided from samples of other lengths: "
                             "decide it from the same samples (layout.decide_tree)")
        _check_ids(flat, offsets, prompt_lengths, vocab_size)
    lengths = np.diff(offsets)
    if tree.num_nodes and ((tree.node_end > lengths[tree.node_sample]).any() or (tree.node_start >= tree.node_end).any()):
        raise ValueError("the prefix tree given to build_layout does not fit these samples' lengths: "
                         "decide it from the same samples (layout.decide_tree)")
    return flat, offsets, prompt_lengths


def build_layout(
    samples: Sequence[Sample],
    *,
    share: Union[bool, str] = True,
    pad_multiple: int = 1,
    vocab_size: Optional[int] = None,
    pad_token_id: int = 0,
    total_multiple: int = 1,
    prompt_values: bool = True,
    min_shared: Optional[int] = None,
    max_depth: Optional[int] = None,
    share_classes: Optional[Sequence[Hashable]] = None,
    tree: Optional[PrefixTree] = None,
) -> PackedPrefixLayout:
    """Pack `samples` (any order) into one prefix-shared THD layout; see the module docstring.

    `share`: True / "prompt" shares identical prompts (one level), "tree" every common prefix (the
    radix tree, `min_shared` and `max_depth` limit it: `ps_bridge.tree.decide.token_trie`), False
    nothing. `share_classes` (one per sample, e.g. temperatures): samples of different classes never
    share a position. `prompt_values=False` (shared layouts only; an unshared one always computes
    every position) lists the read positions in `output_positions`: the output layer then skips the
    other positions, whose rows hold 0. The default here computes every position; runs configured by
    a `PrefixSharingConfig` pass its `prompt_values` (default False). `tree`: the prefix tree already
    decided for these samples (`decide_tree` with the same `share` and options, e.g. for the sharing
    rule's counts), packed as it is instead of being decided again."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if total_multiple < 1:
        raise ValueError(f"total_multiple must be >= 1, got {total_multiple}")
    samples = [s if isinstance(s, Sample) else Sample(*s) for s in samples]
    _check_share_classes(share_classes, len(samples))
    if tree is None:
        flat, offsets, prompt_lengths = _flatten(samples, vocab_size)
        tree = decide_sharing(
            samples, flat, offsets, prompt_lengths, share,
            min_shared=min_shared, max_depth=max_depth, share_classes=share_classes,
        )
    else:
        flat, offsets, prompt_lengths = _given_tree_sequences(samples, tree, vocab_size)
    return materialize(
        flat, offsets, prompt_lengths, tree, pack_order(tree),
        shared=share is not False, pad_multiple=pad_multiple, total_multiple=total_multiple,
        pad_token_id=pad_token_id, prompt_values=prompt_values, vocab_size=vocab_size,
    )


def samples_from_padded(
    prompts: torch.Tensor,
    responses: torch.Tensor,
    attention_mask: torch.Tensor,
    uids: Optional[Sequence] = None,
) -> List[Sample]:
    """verl's form: prompts `[B, Pmax]` left-padded, responses `[B, Rmax]` right-padded,
    `attention_mask` `[B, Pmax + Rmax]` marking the valid tokens of both."""
    if prompts.dim() != 2 or responses.dim() != 2 or attention_mask.dim() != 2:
        raise ValueError("prompts, responses and attention_mask must be 2-D [batch, length] tensors")
    B, Pmax = prompts.shape
    if responses.shape[0] != B or attention_mask.shape != (B, Pmax + responses.shape[1]):
        raise ValueError(
            f"shape mismatch: prompts {tuple(prompts.shape)}, responses {tuple(responses.shape)}, "
            f"attention_mask {tuple(attention_mask.shape)} (expected [B, Pmax + Rmax])"
        )
    mask = attention_mask.bool().cpu()
    prompts, responses = prompts.cpu(), responses.cpu()
    out = []
    for i in range(B):
        pm, rm = mask[i, :Pmax], mask[i, Pmax:]
        p = prompts[i][pm].tolist()
        r = responses[i][rm].tolist()
        if pm.any() and not bool(pm[pm.nonzero()[0, 0] :].all()):
            raise ValueError(f"sample {i}: the prompt mask has holes; prompts must be left-padded")
        if rm.any() and not bool(rm[: int(rm.sum())].all()):
            raise ValueError(f"sample {i}: the response mask has holes; responses must be right-padded")
        out.append(Sample(p, r, None if uids is None else uids[i]))
    return out


def log_layout(layout: PackedPrefixLayout, rank_info: str = "") -> None:
    """The seed's `[PS][prepare]` lines: which path was taken and the packed layout."""
    if layout.has_sharing:
        logger.info("[PS][prepare] PATH 6: sharing detected (groups=%d, samples=%d)", layout.num_groups, layout.num_samples)
    else:
        logger.info("[PS][prepare] PATH 5: no sharing detected (samples=%d)", layout.num_samples)
    logger.info("[PS][prepare]%s packed_batch_layout: %s", rank_info, layout.describe())
