"""The one call of a prefix-aware model on a packed micro-batch.

The CLI, the schedule (and so every parallel layout), the bench and the verl engine all run the
model through `run_packed`: the layout's tokens and per-token positions as one THD sequence, and
`PrefixSharedPackedSeqParams` carrying the layout, the attention backend and (derived on demand)
the MoE token weights. What comes back is megatron's output for this pipeline stage: the packed
logits `[1, T, V / tp]` on the last stage, hidden states on the others.
"""

from __future__ import annotations

import torch

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.layout import PackedPrefixLayout


def run_packed(model: torch.nn.Module, layout: PackedPrefixLayout, config: PrefixSharingConfig) -> torch.Tensor:
    """`model` (megatron's module, wrapped or not) on the packed sequence of `layout` (on the model's
    device), with `config.backend` as the softmax-attention backend."""
    from ps_bridge.models.packed_seq import PrefixSharedPackedSeqParams

    return model(
        input_ids=layout.tokens.unsqueeze(0),
        position_ids=layout.positions.unsqueeze(0),
        attention_mask=None,
        packed_seq_params=PrefixSharedPackedSeqParams.from_layout(layout, attention_backend=config.backend),
    )
