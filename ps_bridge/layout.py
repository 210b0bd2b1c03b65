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
at its position in its own sequence, each node attending to its ancestors' tokens (docs/how-it-works.md).
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
from itertools import chain
from typing import Hashable, List, Optional, Sequence, Union

import numpy as np
import torch

from ps_bridge.images import has_images, image_signature, pack_images, prompt_image_signature, sharing_keys
from ps_bridge.packed_layout import PackedPrefixLayout, Sample, cumulative_offsets  # noqa: F401 (re-exported)
from ps_bridge.tree.decide import PrefixTree, prompt_tree, token_trie, unshared_tree
from ps_bridge.tree.materialize import materialize
from ps_bridge.tree.order import PackOrder, pack_order

logger = logging.getLogger("ps_bridge")

PAD_SEGMENT = -1

# the shortest common run a "tree" layout shares by default (shorter runs are computed per sample):
# measured with `ps-bridge bench --min-shared-sweep` on an H200 (docs/how-it-works.md, "Choosing the threshold"):
# sharing a run of K <= 64 tokens among 8 prompts was slower than computing it in every prompt on every
# measured shape (x 0.80-0.95), so the default is the largest such run. A whole prompt shared by all
# its responses is shared whatever its length (`tree.decide.token_trie(prompt_lengths=...)`), as one
# level shares it: a tree never shares less than one level
DEFAULT_MIN_SHARED = 64


# ---- building: decide what is shared, order the pack, materialize ---------------------------

SHARE_MODES = ("prompt", "tree")


class SampleBatch(list):
    """A list of `Sample`s cut from one flat token array (verl's nested `input_ids`:
    `ps_bridge.verl.batch.samples_from_micro_batch`) that keeps the array: the layout takes the tokens
    from it instead of converting every token of the lists again (the largest part of the host time).
    The array serves only while the list holds exactly the samples it was made with."""

    def __init__(self, samples: Sequence[Sample], tokens: np.ndarray, offsets: np.ndarray, prompt_lengths: np.ndarray):
        super().__init__(samples)
        self._made_of = tuple(self)
        self._sequences = (np.asarray(tokens, dtype=np.int64), np.asarray(offsets, dtype=np.int64),
                           np.asarray(prompt_lengths, dtype=np.int64))

    def sequences(self):
        """(tokens, offsets, prompt lengths) as `_flatten` returns them, or None if the list changed."""
        if len(self) != len(self._made_of) or any(a is not b for a, b in zip(self, self._made_of)):
            return None
        return self._sequences


def _as_samples(samples) -> List[Sample]:
    """`Sample`s (a `SampleBatch` as it is, tuples converted)."""
    if isinstance(samples, SampleBatch):
        return samples
    return [s if isinstance(s, Sample) else Sample(*s) for s in samples]


def _check_not_empty(prompt_lengths: np.ndarray, offsets: np.ndarray) -> None:
    """The first sample with an empty prompt or response refused, its prompt named first (the order in
    which `_flatten`'s loop over a list of samples finds them)."""
    empty_prompt, empty_response = prompt_lengths == 0, np.diff(offsets) == prompt_lengths
    bad = empty_prompt | empty_response
    if bad.any():
        i = int(np.argmax(bad))
        if empty_prompt[i]:
            raise ValueError(f"sample {i}: the prompt is empty (a prompt needs at least one token)")
        raise ValueError(f"sample {i}: the response is empty (a response needs at least one token)")


def _flatten(samples: Sequence[Sample], vocab_size: Optional[int]):
    """Every sample's `prompt + response` as one int64 array, its offsets and prompt lengths,
    checked without a Python loop over the tokens."""
    if len(samples) == 0:
        raise ValueError("the micro-batch is empty: at least one sample is needed")
    given = samples.sequences() if isinstance(samples, SampleBatch) else None
    if given is not None:  # cut from an integer array: the tokens are integers
        flat, offsets, prompt_lengths = given
        _check_not_empty(prompt_lengths, offsets)
        _check_ids(flat, offsets, prompt_lengths, vocab_size)
        return flat, offsets, prompt_lengths
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
    Prompts with images are identical only where their images are too (`images.prompt_image_signature`).
    """
    by_prompt: dict = {}
    groups: List[List[int]] = []
    for i, s in enumerate(samples):
        key = tuple(s.prompt) if classes is None else (classes[i], tuple(s.prompt))
        if s.images:
            key = (key, prompt_image_signature(s))
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


def _tree_of_sequences(
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
        # image placeholders compared by their images (`images.sharing_keys`), not by their ids
        return token_trie(
            sharing_keys(samples, flat, offsets), offsets, classes=share_classes, max_depth=max_depth,
            min_shared=DEFAULT_MIN_SHARED if min_shared is None else min_shared, prompt_lengths=prompt_lengths,
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
    samples = _as_samples(samples)
    flat, offsets, prompt_lengths = _flatten(samples, vocab_size)
    _check_share_classes(share_classes, len(samples))
    tree = _tree_of_sequences(
        samples, flat, offsets, prompt_lengths, share,
        min_shared=min_shared, max_depth=max_depth, share_classes=share_classes,
    )
    tree.sequences = (flat, offsets, prompt_lengths)  # build_layout(tree=...) packs these, not flattened again
    tree.images = tuple(map(image_signature, samples)) if has_images(samples) else None
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
    order: Optional[PackOrder] = None,
    bucket: bool = False,
    level_buckets: bool = False,
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
    rule's counts), packed as it is instead of being decided again; `order`: its pack order
    (`tree.order.pack_order(tree)`, e.g. from a `plan.SharingPlan`), else computed here. `bucket`:
    every segment of a tree level padded to the level's bucket length, the output layer on the positions
    the structure fixes (`tree.materialize.bucket_length`, `bucketed_read_positions`: the shape CUDA graphs
    replay, `ps_bridge.cuda_graphs`);
    `level_buckets` (with `bucket`): segments at their own lengths, each level's block padded to a
    bucket instead (`ps_bridge.tree.level_buckets`)."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if total_multiple < 1:
        raise ValueError(f"total_multiple must be >= 1, got {total_multiple}")
    samples = _as_samples(samples)
    _check_share_classes(share_classes, len(samples))
    if tree is None:
        flat, offsets, prompt_lengths = _flatten(samples, vocab_size)
        tree = _tree_of_sequences(
            samples, flat, offsets, prompt_lengths, share,
            min_shared=min_shared, max_depth=max_depth, share_classes=share_classes,
        )
    else:
        flat, offsets, prompt_lengths = _given_tree_sequences(samples, tree, vocab_size)
    if order is None:
        order = pack_order(tree)
    layout = materialize(
        flat, offsets, prompt_lengths, tree, order,
        shared=share is not False, pad_multiple=pad_multiple, total_multiple=total_multiple,
        pad_token_id=pad_token_id, prompt_values=prompt_values, vocab_size=vocab_size, bucket=bucket,
        level_buckets=level_buckets,
    )
    if has_images(samples):
        # an unshared pack runs the vision tower once per image run, as the stock model does
        layout.images = pack_images(samples, offsets, layout.host["token_source"], layout.positions.numpy(),
                                    dedupe=share is not False)
    return layout


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
