"""`GPTModel` that applies RoPE at the per-token positions of the packed prefix layout.

megatron-core's THD RoPE restarts at 0 for every packed sequence. In the prefix-shared pack a
response is its own THD sequence but must continue the positions of its prompt (`P, P+1, ...`).
megatron-core applies a frequency table per token when the table is exactly as long as the pack,
so `_preprocess` replaces the table by one built from `layout.positions`. Everything else is
megatron-core's GPTModel, so parameter names, pipeline stages and the output layer stay stock.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_model import GPTModel


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


class PrefixSharedGPTModel(GPTModel):
    """GPTModel + per-token RoPE positions from `packed_seq_params.prefix_layout`."""

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
        return (out[0], table) + tuple(out[2:])
