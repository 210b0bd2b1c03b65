"""Packed per-position outputs -> one row of `P_i + R_i` values per sample: the one row extractor.

The packed model output has one position per packed token. A sample's row position `t` reads the
packed position `layout.row_source[t]` with label `row_label[t]` (the sample's own next token; -1
for the last row position, which has no label and holds 0). Every row of a shared prompt position
has the same label except the *fork* rows (row position `P_i - 1`: the shared last prompt position,
labelled with response i's first token): this is where prefix sharing hands every response its own
first log-prob.

`PackedRows` is used by the CLI, the schedule, the bench and the verl engine (which passes verl's own
labels); per-token values that need no label (entropy, sum of squared probabilities) go through
`values`. Log-probs are computed once per packed position plus once per fork row, never for an
`[N, V]` copy of the logits with N the unshared token count.

When tensor parallelism does not divide the vocabulary, megatron's embedding and output layer are
padded (Megatron-Bridge's `should_pad_vocab`) with zero rows: the padded columns' logits are 0, not
-inf. A layout built for a model knows its true `vocab_size`; the ids at or above it are kept out of
the softmax (and get no gradient), so the log-probs are those of the true vocabulary.

Under context parallelism a rank holds the logits of its own contiguous shard of the pack only
(`cp_shard`). Its rows then hold the values of the row positions whose packed position lies in its
shard (a fork row included: it belongs to the rank holding its prompt's last position) and 0
elsewhere; no logits cross ranks. A rank's loss is that of its own rows (megatron's CP: the gradient
reduction over the CP group completes it), and `complete` sums the ranks' rows into the full rows
for reporting.

When the layout lists read positions (`layout.output_positions`: each response position and each
prompt's last position, the default of prefix-shared runs), the model ran its output layer on those
positions only: the logits are `[G + sum R_i, V / tp]` (of this rank's shard under CP), `source`
indexes them, and the rows of the other prompt positions (row positions before `P_i - 1`) hold 0,
log-prob and per-token value alike. verl's losses read from `P_i - 1` on (`response_mask`).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ps_bridge.kernels import vocab_softmax
from ps_bridge.layout import PackedPrefixLayout


class PackedRows:
    """Where each row position of each sample reads its packed value, and with which label."""

    def __init__(
        self,
        layout: PackedPrefixLayout,
        labels: Optional[torch.Tensor] = None,
        vocab_size: Optional[int] = None,
        cp_shard: Optional[slice] = None,
    ):
        device = layout.device
        self.vocab_size = layout.vocab_size if vocab_size is None else vocab_size
        self.layout = layout
        self.cp_shard = cp_shard
        source = layout.row_source.to(device)
        self.labels = (layout.row_label if labels is None else labels).to(device=device, dtype=torch.long)
        if self.labels.shape != source.shape:
            raise ValueError(f"{self.labels.numel()} row labels for {source.numel()} row positions")
        self.offsets = layout.host_lengths("row_offsets")
        if cp_shard is None:
            local, start = layout.num_tokens, 0
            in_shard = torch.ones_like(source, dtype=torch.bool)
        else:  # positions of this rank's shard, local offsets; the other rows are masked
            local, start = cp_shard.stop - cp_shard.start, cp_shard.start
            in_shard = (source >= cp_shard.start) & (source < cp_shard.stop)
        local_source = torch.where(in_shard, source - start, 0)
        selected = layout.logit_positions(cp_shard)
        if selected is None:  # the model computed every position of this rank's tokens
            self.num_positions = local
            self.computed = in_shard
            self.source = local_source
        else:  # the model computed `selected` only (`layout.output_positions`): index into those
            self.num_positions = int(selected.numel())
            index = torch.full((local,), -1, dtype=torch.long, device=device)
            index[selected] = torch.arange(self.num_positions, device=device)
            self.computed = in_shard & layout.output_mask()[source]
            self.source = torch.where(self.computed, index[local_source], 0)
        self.has_label = (self.labels >= 0) & self.computed
        self.safe_labels = self.labels.clamp(min=0)

    @classmethod
    def of(cls, layout: PackedPrefixLayout, cp_shard: Optional[slice] = None) -> "PackedRows":
        """The rows of `layout` with its own labels (built once per layout, device and CP shard)."""
        key = ("packed_rows", str(layout.device), None if cp_shard is None else (cp_shard.start, cp_shard.stop))
        return layout.derived(key, lambda: cls(layout, cp_shard=cp_shard))

    def complete(self, rows: torch.Tensor, cp_group=None) -> torch.Tensor:
        """The full rows on every CP rank from each rank's rows of its shard, as verl's CP output
        gather hands them back (`postprocess_packed_seqs`): the other ranks' values are summed in
        without gradient, so a loss of the full rows sends gradient to this rank's own rows only
        (megatron's CP gradient reduction completes it). The rows themselves without CP."""
        if self.cp_shard is None:
            return rows
        group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
        summed = rows.detach().clone()
        dist.all_reduce(summed, group=group)
        # own rows: r + (r - r) = r exactly (the other ranks hold exact zeros there); others: 0 + s
        return rows + (summed - rows.detach())

    # ---- values -> rows --------------------------------------------------------------------
    def values(self, packed: torch.Tensor) -> torch.Tensor:
        """Flattened rows `[sum(P_i + R_i)]` of a per-position value `[num_positions]` (entropy, ...):
        one per position the model computed (`[T]`; `[T / cp]` of this rank's shard under CP; the read
        positions only when the layout lists them), 0 in the rows of positions not computed here."""
        rows = packed.reshape(-1).index_select(0, self.source)
        return torch.where(self.computed, rows, torch.zeros_like(rows))

    def logprobs(self, logits: torch.Tensor, vocab_parallel: bool = False, tp_group=None, chunk_rows: int = 1024) -> torch.Tensor:
        """Flattened rows of log-probs, float32, from packed logits `[num_positions, V]` (or with a
        leading 1): every position, this rank's CP shard, or the read positions (see `values`).

        `vocab_parallel`: `logits` is this rank's `[T, V / tp]` shard (megatron's parallel output
        layer), normalised across the TP group chunk by chunk (`chunked_vocab_parallel_logprobs`: no
        copy of the logits), every rank returning the same full rows. Otherwise the full vocabulary,
        normalised chunk by chunk."""
        logits = self._packed_2d(logits)
        if vocab_parallel:
            rows = chunked_vocab_parallel_logprobs(self, logits, tp_group, chunk_rows)
        else:
            if chunk_rows < 1:
                raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
            keep = logits.shape[-1] if self.vocab_size is None else min(self.vocab_size, logits.shape[-1])
            rows = _RowLogprobs.apply(logits.contiguous(), self.source, self.safe_labels, int(chunk_rows), keep)
        return torch.where(self.has_label, rows, torch.zeros_like(rows))

    # ---- rows -> per sample ----------------------------------------------------------------
    def split(self, rows: torch.Tensor) -> List[torch.Tensor]:
        """One tensor of length `P_i + R_i` per sample, input order."""
        return [rows[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def nested(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows as a jagged nested tensor (verl's engine output); under CP the full rows
        (`complete`)."""
        return torch.nested.as_nested_tensor(self.split(self.complete(rows)), layout=torch.jagged)

    def responses(self, rows: torch.Tensor) -> List[torch.Tensor]:
        """`log p(response[j] | prompt + response[:j])` per sample: row positions P-1 .. P+R-2."""
        prompt_lengths = self.layout.host_lengths("sample_prompt_length")
        response_lengths = self.layout.host_lengths("sample_response_length")
        return [row[P - 1 : P - 1 + R] for row, P, R in zip(self.split(rows), prompt_lengths, response_lengths)]

    # ---- internals -------------------------------------------------------------------------
    def _packed_2d(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 3:
            logits = logits.reshape(-1, logits.shape[-1])
        if logits.shape[0] != self.num_positions:
            raise ValueError(
                f"logits have {logits.shape[0]} positions, the layout has {self.num_positions}"
                + ("" if self.cp_shard is None else f" in this rank's context-parallel shard {self.cp_shard}")
                + ("" if self.layout.output_positions is None else
                   " read positions (layout.output_positions: run the model through ps_bridge.forward.run_packed, "
                   "which hands them to the output layer, or build the layout with prompt_values=True)")
            )
        return logits


class _RowLogprobs(torch.autograd.Function):
    """Full-vocabulary row log-probs without `[N, V]` float32 copies.

    The log-sum-exp is taken once per *packed* position (T rows, not N: a shared prompt position is
    normalised once however many responses read it), chunk by chunk in float32 from the logits'
    own dtype, and only a row's label logit is gathered. The backward writes the logits' gradient
    chunk by chunk: `onehot(label) * g - softmax * (sum of g over the rows reading that position)`.
    Peak extra memory is one float32 chunk, plus the `[T, V]` gradient every backward produces.
    Columns from `keep` on (a padded vocabulary's extra ids) are out of the log-sum-exp and get no
    gradient.
    """

    @staticmethod
    def forward(ctx, logits, src, label, chunk_rows, keep):
        V = logits.shape[1]
        m, s = _max_sumexp(logits, keep, chunk_rows)
        lse = m + s.log()
        target = logits.reshape(-1).index_select(0, src * V + label).float()
        ctx.save_for_backward(logits, src, label, lse)
        ctx.chunk_rows, ctx.keep = chunk_rows, keep
        return target - lse.index_select(0, src)

    @staticmethod
    def backward(ctx, grad_rows):
        logits, src, label, lse = ctx.saved_tensors
        g = grad_rows.float()
        grad = _minus_weighted_softmax(logits, lse, src, g, ctx.chunk_rows, ctx.keep)
        grad.view(-1).index_put_((src * logits.shape[1] + label,), g.to(grad.dtype), accumulate=True)
        return grad, None, None, None, None


def _max_sumexp(logits, keep: int, chunk_rows: int):
    """Per packed position: the maximum of its logits over columns `[0, keep)` and the sum of
    exp(x - maximum), float32 (keep = 0: -inf and 0). One fused read of the logits on CUDA
    (`kernels.vocab_softmax`), else chunk by chunk in float32."""
    if vocab_softmax.usable(logits):
        return vocab_softmax.row_max_sumexp(logits, keep)
    T = logits.shape[0]
    m = torch.full((T,), float("-inf"), dtype=torch.float32, device=logits.device)
    s = torch.zeros(T, dtype=torch.float32, device=logits.device)
    if keep > 0:
        for a in range(0, T, chunk_rows):
            x = logits[a : a + chunk_rows, :keep].float()
            top = x.max(dim=-1).values
            m[a : a + chunk_rows] = top
            s[a : a + chunk_rows] = (x - top[:, None]).exp_().sum(dim=-1)
    return m, s


def _minus_weighted_softmax(logits, lse, src, g, chunk_rows: int, keep: int) -> torch.Tensor:
    """`-softmax(logits) * (sum of g over the rows reading each position)`, the softmax part of the
    row log-probs' gradient (one fused pass on CUDA: `kernels.vocab_softmax`, else chunk by chunk);
    columns from `keep` on get 0."""
    T = logits.shape[0]
    weight = torch.zeros(T, dtype=torch.float32, device=logits.device).index_add_(0, src, g)
    if vocab_softmax.usable(logits):
        return vocab_softmax.minus_weighted_softmax(logits, lse, weight, keep)
    grad = torch.empty_like(logits)
    c = chunk_rows
    for a in range(0, T, c):
        # in place: one float32 chunk alive at a time (this runs when every activation is alive,
        # so its temporaries add directly to the step's peak memory)
        # a copy even for float32 logits, whose .float() would be the saved logits themselves
        probs = logits[a : a + c].to(torch.float32, copy=True)
        probs.sub_(lse[a : a + c, None]).exp_().mul_(-weight[a : a + c, None])
        probs[:, keep:] = 0.0  # a padded vocabulary's extra ids (none when keep == V)
        grad[a : a + c] = probs
    return grad


# ---- vocab-parallel rows without a copy of the logits (verl-check engineer) -------------------------


def chunked_vocab_parallel_logprobs(rows: "PackedRows", logits: torch.Tensor, tp_group=None,
                                    chunk_rows: int = 1024) -> torch.Tensor:
    """Row log-probs from this rank's vocabulary shard `[T, V / tp]`, equal to megatron's
    `vocab_parallel_cross_entropy` per row, without its float32 `[T + forks, V / tp]` copy: the
    log-sum-exp of every packed position is taken chunk by chunk and reduced over the TP group (two
    collectives on `[T]` vectors), each row's label logit is read on the rank that holds it (one
    collective on `[N]`), and the backward writes the shard's gradient chunk by chunk."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    group = tp_group
    if group is None and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank(group) if group is not None else 0
    first = rank * logits.shape[-1]
    keep = logits.shape[-1] if rows.vocab_size is None else min(max(rows.vocab_size - first, 0), logits.shape[-1])
    return _VocabParallelRowLogprobs.apply(logits.contiguous(), rows.source, rows.safe_labels, int(chunk_rows),
                                           keep, first, group)


class _VocabParallelRowLogprobs(torch.autograd.Function):
    """`_RowLogprobs` over a vocabulary shard: columns `[first, first + V_local)` of the full
    vocabulary live here, columns from `keep` on are a padded vocabulary's extra ids (out of the
    softmax, no gradient). The gradient needs no collective: the shard's softmax uses the global
    log-sum-exp, and a label's one-hot lands on the rank holding that column."""

    @staticmethod
    def forward(ctx, logits, src, label, chunk_rows, keep, first, group):
        V = logits.shape[1]
        local_max, local_sum = _max_sumexp(logits, keep, chunk_rows)
        global_max = local_max
        if group is not None:
            global_max = local_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            # each shard's sum taken at its own maximum, brought to the global one (a shard holding no
            # column of the true vocabulary has maximum -inf and sum 0: it adds 0)
            local_sum = torch.where(local_max > float("-inf"), local_sum * (local_max - global_max).exp(),
                                    torch.zeros_like(local_sum))
            dist.all_reduce(local_sum, op=dist.ReduceOp.SUM, group=group)
        lse = global_max + local_sum.log()
        local = (label >= first) & (label < first + keep)
        col = (label - first).clamp(0, max(V - 1, 0))
        target = torch.where(local, logits.reshape(-1).index_select(0, src * V + col).float(),
                             torch.zeros((), dtype=torch.float32, device=logits.device))
        if group is not None:
            dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(logits, src, col, local, lse)
        ctx.chunk_rows, ctx.keep = chunk_rows, keep
        return target - lse.index_select(0, src)

    @staticmethod
    def backward(ctx, grad_rows):
        logits, src, col, local, lse = ctx.saved_tensors
        g = grad_rows.float()
        grad = _minus_weighted_softmax(logits, lse, src, g, ctx.chunk_rows, ctx.keep)
        # the label's own column, where this rank holds it; elsewhere 0 added at index 0 (exact, and
        # no boolean indexing: that would make the host wait for the GPU)
        where = torch.where(local, src * logits.shape[1] + col, torch.zeros_like(src))
        add = torch.where(local, g, torch.zeros_like(g)).to(grad.dtype)
        grad.view(-1).index_put_((where,), add, accumulate=True)
        return grad, None, None, None, None, None, None


def chunked_vocab_parallel_entropy(logits: torch.Tensor, tp_group=None, chunk_rows: int = 1024) -> torch.Tensor:
    """Entropy of the softmax of every packed position `[T]` (float32) from this rank's vocabulary
    shard `[T, V / tp]`, equal to verl's `vocab_parallel_entropy`, chunk by chunk: no `[T, V / tp]`
    float32 softmax or copy. Every column present counts (as verl's function counts them)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    group = tp_group
    if group is None and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    return _VocabParallelEntropy.apply(logits.reshape(-1, logits.shape[-1]).contiguous(), int(chunk_rows), group)


class _VocabParallelEntropy(torch.autograd.Function):
    """H = lse - E[x] per position; dH/dx_j = -p_j (x_j - E[x]). Forward: max, sum of exp and sum of
    exp * x per position, reduced over the TP group; backward local, chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, chunk_rows, group):
        T = logits.shape[0]
        m = torch.empty(T, dtype=torch.float32, device=logits.device)
        for a in range(0, T, chunk_rows):
            m[a : a + chunk_rows] = logits[a : a + chunk_rows].float().max(dim=-1).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        sums = torch.zeros(2, T, dtype=torch.float32, device=logits.device)  # sum exp, sum exp * x
        for a in range(0, T, chunk_rows):
            x = logits[a : a + chunk_rows].float()
            e = (x - m[a : a + chunk_rows, None]).exp_()
            sums[0, a : a + chunk_rows] = e.sum(dim=-1)
            sums[1, a : a + chunk_rows] = (e * x).sum(dim=-1)
        if group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = m + sums[0].log()
        mean_x = sums[1] / sums[0]
        ctx.save_for_backward(logits, lse, mean_x)
        ctx.chunk_rows = chunk_rows
        return lse - mean_x

    @staticmethod
    def backward(ctx, grad):
        logits, lse, mean_x = ctx.saved_tensors
        g = grad.float()
        out = torch.empty_like(logits)
        c = ctx.chunk_rows
        for a in range(0, logits.shape[0], c):
            x = logits[a : a + c].float()
            p = (x - lse[a : a + c, None]).exp_()
            out[a : a + c] = (-p * (x - mean_x[a : a + c, None]) * g[a : a + c, None]).to(out.dtype)
        return out, None, None
