"""Core attention of the Qwen3.5 vision tower where Transformer Engine is absent.

Megatron-Bridge's `Qwen3VLVisionModel` packs all images (each frame) of a call into one THD sequence
and hands its attention `packed_seq_params` with one `cu_seqlens` segment per frame: every patch
attends to every patch of its own frame (bidirectional), to none of another's. megatron-core's
local `DotProductAttention` refuses packed sequences (megatron/core/transformer/dot_product_attention.py),
so without TE the tower could not run at all; this module is what `local_vision_tower()` gives it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class VisionCoreAttention(MegatronModule):
    """Non-causal softmax attention inside each `cu_seqlens_q` segment: THD `query/key/value
    [t, heads, dim]` (this TP rank's heads) -> `[t, heads * dim]`."""

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self", attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"the vision tower's local attention has no dropout; got attention_dropout={dropout}")
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is None or query.dim() != 3:
            raise ValueError("the vision tower's local attention takes THD input with packed_seq_params (one segment per frame)")
        bounds = packed_seq_params.cu_seqlens_q.tolist()  # host: one sync per layer, a few images
        rep = query.shape[1] // key.shape[1]
        out = torch.empty_like(query)
        for a, b in zip(bounds[:-1], bounds[1:]):
            q = query[a:b].transpose(0, 1)
            k = key[a:b].transpose(0, 1).repeat_interleave(rep, dim=0)
            v = value[a:b].transpose(0, 1).repeat_interleave(rep, dim=0)
            out[a:b] = F.scaled_dot_product_attention(q, k, v, scale=self.scale).transpose(0, 1)
        return out.reshape(out.shape[0], -1)
