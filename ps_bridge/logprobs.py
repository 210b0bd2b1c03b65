"""Log-probs per sample from the logits of a packed layout.

The packed logits have one row per packed position; a sample's row position `t` reads the packed
position `layout.row_source[t]` with label `layout.row_label[t]`. The shared last prompt position is
read once per response of its group, each with that response's first token as label: this is where
prefix sharing hands every response its own first log-prob.

When tensor parallelism does not divide the vocabulary, megatron's embedding and output layer are
padded (Megatron-Bridge's `should_pad_vocab`) with zero rows: the padded columns' logits are 0,
not -inf. Every extractor here takes the checkpoint's true `vocab_size` and keeps the ids at or
above it out of the softmax (their gradient is zero), so the log-probs are those of the true
vocabulary.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ps_bridge.layout import PackedPrefixLayout


def _packed_2d(logits: torch.Tensor, layout: PackedPrefixLayout) -> torch.Tensor:
    if logits.dim() == 3:
        logits = logits.reshape(-1, logits.shape[-1])
    if logits.shape[0] != layout.num_tokens:
        raise ValueError(f"logits have {logits.shape[0]} positions, the layout has {layout.num_tokens}")
    return logits


def _true_vocab_columns(width: int, vocab_size: Optional[int], first_id: int = 0) -> Optional[int]:
    """How many of the `width` logit columns (vocabulary ids `first_id ..`) are true vocabulary
    ids, or None when all are (no padding, or `vocab_size` not given)."""
    if vocab_size is None or first_id + width <= vocab_size:
        return None
    return max(vocab_size - first_id, 0)


def packed_row_logprobs(logits: torch.Tensor, layout: PackedPrefixLayout, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Flattened per-sample rows of log-probs, `[sum(P_i + R_i)]`, float32.

    `logits` is `[T, V]` (or `[1, T, V]`) over the packed positions, full vocabulary (`V` may be
    the padded size; `vocab_size` is then the true one and the padded columns are left out).
    The last row position of every sample has no label and holds 0.
    """
    logits = _packed_2d(logits, layout)
    keep = _true_vocab_columns(logits.shape[-1], vocab_size)
    if keep is not None:
        logits = logits[:, :keep]
    src = layout.row_source.to(logits.device)
    label = layout.row_label.to(logits.device)
    has_label = label >= 0
    picked = logits.index_select(0, src).float()  # [N, V]; the shared last prompt row is repeated
    lse = torch.logsumexp(picked, dim=-1)
    target = picked.gather(1, label.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(has_label, target - lse, torch.zeros_like(lse))


def vocab_parallel_row_logprobs(
    logits: torch.Tensor, layout: PackedPrefixLayout, tp_group=None, vocab_size: Optional[int] = None
) -> torch.Tensor:
    """`packed_row_logprobs` from logits split over the vocabulary across the TP group.

    `logits` is this rank's `[T, V / tp]` shard (megatron's parallel output layer). The rows are
    gathered on every rank first, then megatron's `vocab_parallel_cross_entropy` reduces the
    maximum, the target logit and the exponential sum across the group: every TP rank returns the
    same full rows, equal to the full-vocabulary computation, and the gradient flows back to each
    rank's shard. With a padded vocabulary the ids at or above `vocab_size` (the last shards'
    tail) get logit -inf: they add nothing to the exponential sum and receive no gradient.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.utils import VocabUtility
    from megatron.core.utils import get_pg_rank, get_pg_size

    logits = _packed_2d(logits, layout)
    src = layout.row_source.to(logits.device)
    label = layout.row_label.to(logits.device)
    has_label = label >= 0
    # index_select makes a new tensor: megatron's cross entropy edits its input in place
    picked = logits.index_select(0, src).float()
    if vocab_size is not None:
        group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        width = picked.shape[-1]
        first_id, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(width, get_pg_rank(group), get_pg_size(group))
        keep = _true_vocab_columns(width, vocab_size, first_id)
        if keep is not None:
            picked[:, keep:] = float("-inf")
    nll = vocab_parallel_cross_entropy(picked, label.clamp(min=0), tp_group=tp_group)
    return torch.where(has_label, -nll, torch.zeros_like(nll))


def row_logprobs_from_logits(
    logits: torch.Tensor, layout: PackedPrefixLayout, vocab_parallel: bool, vocab_size: Optional[int] = None
) -> torch.Tensor:
    """Rows from full-vocabulary logits, or from this rank's vocabulary shard when TP > 1;
    `vocab_size` is the true vocabulary when the model's is padded."""
    if vocab_parallel:
        return vocab_parallel_row_logprobs(logits, layout, vocab_size=vocab_size)
    return packed_row_logprobs(logits, layout, vocab_size=vocab_size)


def split_rows(rows: torch.Tensor, layout: PackedPrefixLayout) -> List[torch.Tensor]:
    """Cut flattened rows into one tensor of length `P_i + R_i` per sample, input order."""
    offsets = layout.row_offsets.tolist()
    return [rows[offsets[i] : offsets[i + 1]] for i in range(layout.num_samples)]


def response_logprobs(rows: torch.Tensor, layout: PackedPrefixLayout) -> List[torch.Tensor]:
    """`log p(response[j] | prompt + response[:j])` for each sample: row positions P-1 .. P+R-2."""
    # one host copy of the lengths, not two device reads per sample
    prompt_lengths = layout.sample_prompt_length.tolist()
    response_lengths = layout.sample_response_length.tolist()
    return [row[P - 1 : P - 1 + R] for row, P, R in zip(split_rows(rows, layout), prompt_lengths, response_lengths)]


class _ChunkedRowLogprobs(torch.autograd.Function):
    """`packed_row_logprobs` without the `[N, V]` float32 copies.

    The log-sum-exp is taken once per *packed* position (T rows, not N: a shared prompt position is
    normalised once however many responses read it), chunk by chunk in float32 from the logits'
    own dtype, and only a row's label logit is gathered. The backward writes the logits' gradient
    chunk by chunk: `onehot(label) * g - softmax * (sum of g over the rows reading that position)`.
    Peak extra memory is one float32 chunk, plus the `[T, V]` gradient every backward produces.
    Columns from `keep` on (padded vocabulary ids) are out of the log-sum-exp and get no gradient.
    """

    @staticmethod
    def forward(ctx, logits, src, label, chunk_rows, keep):
        T, V = logits.shape
        has_label = label >= 0
        safe_label = label.clamp(min=0)
        lse = torch.empty(T, dtype=torch.float32, device=logits.device)
        for a in range(0, T, chunk_rows):
            lse[a : a + chunk_rows] = torch.logsumexp(logits[a : a + chunk_rows, :keep].float(), dim=-1)
        target = logits.reshape(-1).index_select(0, src * V + safe_label).float()
        rows = torch.where(has_label, target - lse.index_select(0, src), torch.zeros_like(target))
        ctx.save_for_backward(logits, src, safe_label, has_label, lse)
        ctx.chunk_rows, ctx.keep = chunk_rows, keep
        return rows

    @staticmethod
    def backward(ctx, grad_rows):
        logits, src, safe_label, has_label, lse = ctx.saved_tensors
        T, V = logits.shape
        g = torch.where(has_label, grad_rows.float(), torch.zeros_like(grad_rows, dtype=torch.float32))
        weight = torch.zeros(T, dtype=torch.float32, device=logits.device).index_add_(0, src, g)
        grad = torch.empty_like(logits)
        c = ctx.chunk_rows
        for a in range(0, T, c):
            # in place: one float32 chunk alive at a time (this runs when every activation is alive,
            # so its temporaries add directly to the step's peak memory)
            # a copy even for float32 logits, whose .float() would be the saved logits themselves
            probs = logits[a : a + c].to(torch.float32, copy=True)
            probs.sub_(lse[a : a + c, None]).exp_().mul_(-weight[a : a + c, None])
            probs[:, ctx.keep :] = 0.0  # padded vocabulary ids (none when keep == V)
            grad[a : a + c] = probs
        grad.view(-1).index_put_((src * V + safe_label,), g.to(grad.dtype), accumulate=True)
        return grad, None, None, None, None


def packed_row_logprobs_chunked(
    logits: torch.Tensor, layout: PackedPrefixLayout, chunk_rows: int = 1024, vocab_size: Optional[int] = None
) -> torch.Tensor:
    """Same rows as `packed_row_logprobs` (float32, padded vocabulary ids left out likewise),
    memory-lean for large vocabularies and packs: no `[N, V]` float32 tensor is formed, forward or
    backward (see `_ChunkedRowLogprobs`)."""
    logits = _packed_2d(logits, layout)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    keep = _true_vocab_columns(logits.shape[-1], vocab_size)
    src = layout.row_source.to(logits.device)
    label = layout.row_label.to(logits.device)
    return _ChunkedRowLogprobs.apply(
        logits.contiguous(), src, label, int(chunk_rows), logits.shape[-1] if keep is None else keep
    )
