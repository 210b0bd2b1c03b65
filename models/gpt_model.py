"""`GPTModel` that applies RoPE at the per-token positions of the packed prefix layout.

megatron-core's THD RoPE restarts at 0 for every packed sequence. In the prefix-shared pack a
response is its own THD sequence but must continue the positions of its prompt (`P, P+1, ...`).
megatron-core applies a frequency table per token when the table is exactly as long as the pack,
so `_preprocess` replaces the table by one built from `layout.positions`. Everything else is
megatron-core's GPTModel, so parameter names, pipeline stages and the output layer stay stock.

The output layer runs only on the positions whose values the rows read when the micro-batch says
so (`packed_seq_params.output_positions`, from the layout: each response position and each prompt's
last position): `SelectedOutputsMixin._postprocess` takes those rows of the final hidden states
with one `index_select` and hands them to megatron's `_postprocess`, so the logits are
`[1, G + sum R_i, V / tp]` instead of `[1, T, V / tp]`. Under sequence parallelism the hidden states
are this rank's sequence shard; they are gathered first (megatron's output layer would gather them
too), and the output layer then runs without its own sequence-parallel gather: the gather's backward
keeps this rank's part of a gradient the output layer's input-gradient all-reduce has already
summed over TP, which is the gradient megatron's reduce-scatter gives. Under CP the positions are
those of this rank's shard. Tied embeddings, the padded vocabulary and pipeline stages are
untouched: the selection happens where megatron applies the output layer, on the last stage only.

Under context parallelism each rank runs one contiguous shard of the pack (`forward.run_packed`).
megatron's THD RoPE under CP reads a rank's table entries in its load-balanced ("zigzag") order:
the first half of rank r's tokens at table rows `r*h .. (r+1)*h`, the second half at
`T-(r+1)*h .. T-r*h` (h = half a shard). `cp_rope_table` places every shard's per-token entries
there, so each rank's tokens get exactly their own layout positions.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


def rope_table_for_positions(rotary_pos_emb, positions: torch.Tensor) -> torch.Tensor:
    """The `[T, 1, 1, dim]` table megatron's `RotaryEmbedding.get_emb` would give, at `positions`."""
    inv_freq = rotary_pos_emb.inv_freq.to(positions.device)
    seq = positions.to(inv_freq.dtype)
    if rotary_pos_emb.seq_len_interpolation_factor is not None:
        seq = seq * (1.0 / rotary_pos_emb.seq_len_interpolation_factor)
    freqs = torch.outer(seq, inv_freq)
    if not rotary_pos_emb.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def cp_rope_table(table: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The per-token table `[T, ...]` of the contiguous shards of `cp_size` ranks, reordered so that
    megatron's THD RoPE under CP (`_get_thd_freqs_on_this_cp_rank`, whole pack as one sequence)
    hands each rank its own shard's rows."""
    if cp_size == 1:
        return table
    T = table.shape[0]
    if T % (2 * cp_size):
        raise ValueError(f"under context parallelism the pack ({T} tokens) must divide by 2 x CP = {2 * cp_size}")
    h = T // (2 * cp_size)
    halves = table.view(cp_size, 2, h, *table.shape[1:])  # [rank, first/second half, h, ...]
    # megatron's order: the first halves of ranks 0..cp-1, then the second halves of ranks cp-1..0
    return torch.cat([halves[:, 0].reshape(-1, *table.shape[1:]), halves.flip(0)[:, 1].reshape(-1, *table.shape[1:])])


class SelectedOutputsMixin:
    """Before a GPTModel's `_postprocess`: keep the hidden states of `packed_seq_params.output_positions`
    only (see the module docstring). megatron's `forward` calls `_postprocess` with keywords. With
    `packed_seq_params.hidden_states_only` the model returns those hidden states (gathered under sequence
    parallelism), and `output_logits` applies the output layer to them."""

    def _postprocess(self, hidden_states, **kwargs):
        params = kwargs.get("packed_seq_params")
        positions = getattr(params, "output_positions", None)
        hidden_only = getattr(params, "hidden_states_only", False)
        if not self.post_process or (positions is None and not hidden_only):
            return super()._postprocess(hidden_states=hidden_states, **kwargs)
        if kwargs.get("labels") is not None or self.config.mtp_num_layers or kwargs.get("output_processor") is not None:
            raise ValueError(
                "the prefix-shared model runs its output layer on the read positions only "
                "(layout.output_positions) and then returns logits: labels, multi-token prediction and "
                "output processors are not supported with it; build the layout with prompt_values=True "
                "(PrefixSharingConfig(prompt_values=True)) to compute every position"
            )
        if self.output_layer.sequence_parallel:
            # backward: this rank's part of the (already TP-summed) gradient, see the module docstring
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.pg_collection.tp
            )
        if positions is not None:
            hidden_states = hidden_states.index_select(0, positions.to(hidden_states.device))
        if hidden_only:
            return hidden_states
        return self.output_logits(hidden_states, keep=getattr(params, "output_keep", None), **kwargs)

    def output_logits(self, hidden_states, keep=None, **kwargs):
        """megatron's `_postprocess` without multi-token prediction or labels (the output layer, its logit
        scaling, `[s, b, v] -> [b, s, v]`) on final hidden states that this rank holds whole: under sequence
        parallelism they are gathered already, so the output layer runs without its own gather. `keep`:
        the indices of the hidden states it runs on (a bucketed layout's `output_keep`), else all."""
        if keep is not None:
            hidden_states = hidden_states.index_select(0, keep.to(hidden_states.device))
        kwargs = {name: None for name in _POSTPROCESS_INPUTS} | kwargs
        layer = self.output_layer
        sequence_parallel = layer.sequence_parallel
        layer.sequence_parallel = False
        try:
            return super()._postprocess(hidden_states=hidden_states, **kwargs)
        finally:
            layer.sequence_parallel = sequence_parallel


# the inputs megatron's GPTModel._postprocess takes without a default; none of them is read on the
# way to the logits without multi-token prediction or labels
_POSTPROCESS_INPUTS = ("input_ids", "position_ids", "labels", "rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin")


class PrefixSharedGPTModel(SelectedOutputsMixin, GPTModel):
    """GPTModel + per-token RoPE positions from `packed_seq_params.prefix_layout` + the output layer
    on the read positions only (`packed_seq_params.output_positions`)."""

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None, packed_seq_params=None, **kwargs):
        out = super()._preprocess(
            input_ids,
            position_ids,
            decoder_input=decoder_input,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            **kwargs,
        )
        layout = getattr(packed_seq_params, "prefix_layout", None)
        if layout is None or self.position_embedding_type != "rope" or out[1] is None:
            return out
        table = rope_table_for_positions(self.rotary_pos_emb, layout.positions)
        if packed_seq_params.cp_shard is not None:
            table = cp_rope_table(table, self.config.context_parallel_size)
        return (out[0], table) + tuple(out[2:])
