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
from itertools import accumulate
from typing import Callable, Hashable, Iterable, List, Optional, Sequence, TypeVar

import torch

logger = logging.getLogger("ps_bridge")

PAD_SEGMENT = -1

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
        """True when at least one prompt is stored once for two or more responses."""
        return self.shared and bool((self.group_size > 1).any())

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
            f"tokens_shared={self.tokens_shared}"
        )


# ---- building ----------------------------------------------------------------------------


def _check_samples(samples: Sequence[Sample], vocab_size: Optional[int]) -> None:
    if len(samples) == 0:
        raise ValueError("the micro-batch is empty: at least one sample is needed")
    for i, s in enumerate(samples):
        if len(s.prompt) == 0:
            raise ValueError(f"sample {i}: the prompt is empty (a prompt needs at least one token)")
        if len(s.response) == 0:
            raise ValueError(f"sample {i}: the response is empty (a response needs at least one token)")
        for part, ids in (("prompt", s.prompt), ("response", s.response)):
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool):
                    raise ValueError(f"sample {i}: {part} token {t!r} is not an integer")
                if t < 0 or (vocab_size is not None and t >= vocab_size):
                    raise ValueError(
                        f"sample {i}: {part} token id {t} is out of the vocabulary [0, {vocab_size})"
                        if vocab_size is not None
                        else f"sample {i}: {part} token id {t} is negative"
                    )


def find_groups(samples: Sequence[Sample]) -> List[List[int]]:
    """Group sample indices by identical prompt tokens, in order of first appearance.

    A `uid` never decides: two samples with equal uid but different prompts are different groups
    (verl's uid marks a prompt, but after truncation or templating the tokens are what count).
    """
    by_prompt: dict = {}
    groups: List[List[int]] = []
    for i, s in enumerate(samples):
        key = tuple(s.prompt)
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


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_layout(
    samples: Sequence[Sample],
    *,
    share: bool = True,
    pad_multiple: int = 1,
    vocab_size: Optional[int] = None,
    pad_token_id: int = 0,
    total_multiple: int = 1,
    prompt_values: bool = True,
) -> PackedPrefixLayout:
    """Pack `samples` (any order) into one prefix-shared THD layout; see the module docstring.

    `prompt_values=False` (shared layouts only; an unshared one always computes every position)
    lists the read positions in `output_positions`: the output layer then skips the other prompt
    positions, whose rows hold 0. The default here computes every position; runs configured by a
    `PrefixSharingConfig` pass its `prompt_values` (default False)."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if total_multiple < 1:
        raise ValueError(f"total_multiple must be >= 1, got {total_multiple}")
    samples = [s if isinstance(s, Sample) else Sample(*s) for s in samples]
    _check_samples(samples, vocab_size)

    if share:
        groups = find_groups(samples)
    else:
        groups = [[i] for i in range(len(samples))]

    # Segment list: prompts first (one per group), then responses group by group.
    seg_tokens: List[List[int]] = []
    seg_positions: List[List[int]] = []
    seg_group: List[int] = []
    seg_prompt: List[bool] = []
    group_prompt_len: List[int] = []
    for g, members in enumerate(groups):
        first = samples[members[0]]
        body = list(first.prompt) if share else list(first.prompt) + list(first.response)
        seg_tokens.append(body)
        seg_positions.append(list(range(len(body))))
        seg_group.append(g)
        seg_prompt.append(True)
        group_prompt_len.append(len(first.prompt))
    num_prompt_segments = len(seg_tokens)
    sample_segment = [0] * len(samples)
    sample_group = [0] * len(samples)
    for g, members in enumerate(groups):
        for i in members:
            sample_group[i] = g
            if share:
                p = group_prompt_len[g]
                r = samples[i].response
                sample_segment[i] = len(seg_tokens)
                seg_tokens.append(list(r))
                seg_positions.append(list(range(p, p + len(r))))
                seg_group.append(g)
                seg_prompt.append(False)
            else:
                sample_segment[i] = g

    valid_lengths = [len(t) for t in seg_tokens]
    padded_lengths = [_padded(n, pad_multiple) for n in valid_lengths]
    padded_lengths[-1] += _padded(sum(padded_lengths), total_multiple) - sum(padded_lengths)
    offsets = cumulative_offsets(padded_lengths)
    cu_valid = cumulative_offsets(valid_lengths)

    T = offsets[-1]
    tokens = torch.full((T,), pad_token_id, dtype=torch.long)
    positions = torch.zeros(T, dtype=torch.long)
    segment_ids = torch.empty(T, dtype=torch.long)
    group_ids = torch.empty(T, dtype=torch.long)
    is_prompt = torch.empty(T, dtype=torch.bool)
    valid = torch.zeros(T, dtype=torch.bool)
    for s, (toks, pos) in enumerate(zip(seg_tokens, seg_positions)):
        a, n, e = offsets[s], len(toks), offsets[s + 1]
        tokens[a : a + n] = torch.tensor(toks, dtype=torch.long)
        positions[a : a + n] = torch.tensor(pos, dtype=torch.long)
        # padding continues the positions so RoPE tables stay monotone; it is never attended to
        if e > a + n:
            last = pos[-1]
            positions[a + n : e] = torch.arange(last + 1, last + 1 + e - a - n)
        segment_ids[a:e] = s
        group_ids[a:e] = seg_group[s]
        is_prompt[a:e] = seg_prompt[s]
        valid[a : a + n] = True

    # Inverse map: for each sample, the packed position of each of its P+R tokens.
    row_source: List[torch.Tensor] = []
    row_label: List[torch.Tensor] = []
    for i, s in enumerate(samples):
        P, R = len(s.prompt), len(s.response)
        g = sample_group[i]
        if share:
            r_start = offsets[sample_segment[i]]
            # group g's prompt is segment g
            src = torch.cat([torch.arange(offsets[g], offsets[g] + P), torch.arange(r_start, r_start + R)])
        else:
            src = torch.arange(offsets[g], offsets[g] + P + R)
        labels = torch.tensor(list(s.prompt[1:]) + list(s.response) + [-1], dtype=torch.long)
        row_source.append(src)
        row_label.append(labels)
    row_offsets = cumulative_offsets(len(s.prompt) + len(s.response) for s in samples)
    output_positions = None
    if share and not prompt_values:
        # every response position, and each group's last prompt position (its responses' fork)
        forks = [offsets[g] + group_prompt_len[g] - 1 for g in range(len(groups))]
        responses = [torch.arange(offsets[s], offsets[s] + valid_lengths[s]) for s in range(num_prompt_segments, len(seg_tokens))]
        output_positions = torch.cat([torch.tensor(forks, dtype=torch.long)] + responses)

    group_size = [len(m) for m in groups]
    tokens_unshared = sum(len(s.prompt) + len(s.response) for s in samples)
    tokens_shared = sum(valid_lengths)

    layout = PackedPrefixLayout(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        group_ids=group_ids,
        is_prompt=is_prompt,
        valid=valid,
        segment_group=torch.tensor(seg_group, dtype=torch.long),
        segment_is_prompt=torch.tensor(seg_prompt, dtype=torch.bool),
        valid_lengths=torch.tensor(valid_lengths, dtype=torch.int32),
        padded_lengths=torch.tensor(padded_lengths, dtype=torch.int32),
        cu_seqlens=torch.tensor(cu_valid, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(offsets, dtype=torch.int32),
        group_size=torch.tensor(group_size, dtype=torch.long),
        sample_group=torch.tensor(sample_group, dtype=torch.long),
        sample_segment=torch.tensor(sample_segment, dtype=torch.long),
        sample_prompt_length=torch.tensor([len(s.prompt) for s in samples], dtype=torch.long),
        sample_response_length=torch.tensor([len(s.response) for s in samples], dtype=torch.long),
        row_offsets=torch.tensor(row_offsets, dtype=torch.long),
        row_source=torch.cat(row_source),
        row_label=torch.cat(row_label),
        shared=share,
        pad_multiple=pad_multiple,
        num_prompt_segments=num_prompt_segments,
        tokens_unshared=tokens_unshared,
        tokens_shared=tokens_shared,
        host=dict(
            valid_lengths=valid_lengths,
            padded_lengths=padded_lengths,
            cu_seqlens=cu_valid,
            cu_seqlens_padded=offsets,
            segment_group=seg_group,
            segment_is_prompt=seg_prompt,
            group_size=group_size,
            max_valid_length=max(valid_lengths),
            max_padded_length=max(padded_lengths),
        ),
        vocab_size=vocab_size,
        output_positions=output_positions,
    )
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
