"""Prefix-aware core attention: the `core_attention` submodule of megatron-core's `Attention`.

It receives THD `query [T, Hq, D]`, `key/value [T, Hkv, D]` (already projected, q/k-normed and
rotated at the per-token positions of the layout) and returns `[T, Hq * D]`, like megatron's own
core attentions. The attention pattern comes from the layout in `packed_seq_params`; the kernel
from the named backend. Under context parallelism it receives this rank's shard of the pack and
runs the kernel on the whole pack with a share of the heads (`models/context_parallel.py`).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule

from ps_bridge.kernels.attention import get_attention_backend
from ps_bridge.models.context_parallel import attention_to_head_shards, attention_to_seq_shard
from ps_bridge.models.packed_seq import require_prefix_layout
from ps_bridge.parallel_info import rank_tag

logger = logging.getLogger("ps_bridge")


class PrefixSharedCoreAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"prefix-shared attention has no dropout; set attention_dropout=0 (got {dropout})")
        self.layer_number = layer_number
        head_dim = config.kv_channels
        if softmax_scale is None:
            softmax_scale = getattr(config, "softmax_scale", None) or 1.0 / math.sqrt(head_dim)
        self.softmax_scale = softmax_scale
        self.pg_collection = pg_collection
        self._announced = False

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ) -> torch.Tensor:
        layout = require_prefix_layout(packed_seq_params, "PrefixSharedCoreAttention")
        if query.dim() != 3:
            raise ValueError(
                f"prefix-shared attention expects THD query [tokens, heads, dim], got shape {tuple(query.shape)}"
            )
        cp_group = getattr(self.pg_collection, "cp", None)
        query, key, value = attention_to_head_shards(query, key, value, cp_group)
        if query.shape[0] != layout.num_tokens:
            raise ValueError(
                f"prefix-shared attention received {query.shape[0]} tokens but the packed layout has "
                f"{layout.num_tokens}: this looks like a sequence-parallel local shard; attention must "
                "see the global packed THD sequence (megatron gathers it before linear_qkv)"
            )
        if attention_bias is not None:
            raise ValueError("prefix-shared attention does not take an attention bias")
        backend = packed_seq_params.attention_backend
        if not self._announced or logger.isEnabledFor(logging.DEBUG):
            logger.info(
                "[PS][attention][%s layer=%s] enter prefix-sharing path: backend=%s tokens=%d segments=%d groups=%d",
                rank_tag(self.pg_collection),
                self.layer_number,
                backend,
                layout.num_tokens,
                layout.num_segments,
                layout.num_groups,
            )
            self._announced = True
        out = get_attention_backend(backend)(query, key, value, layout, self.softmax_scale)
        return attention_to_seq_shard(out.reshape(out.shape[0], -1), cp_group)
