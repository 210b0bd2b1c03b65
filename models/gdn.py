"""Prefix-aware Gated DeltaNet: megatron-core's `GatedDeltaNet` with forked prompt states.

Parameters, their shapes, TP sharding and sharded checkpointing are megatron-core's (this class only
replaces `forward`), so Megatron-Bridge's Qwen3.5 names apply unchanged: `in_proj.weight`,
`conv1d.weight`, `A_log`, `dt_bias`, `out_norm.weight`, `out_proj.weight`.

`forward` takes the packed THD sequence (`[T, 1, hidden]`) with the prefix layout in
`packed_seq_params`; the sequence mixing (causal conv1d + gated delta rule) runs prompts first and
then every response from its prompt's final states (`ps_bridge.kernels.gdn`). The backend is the
config's `gdn_backend` (our providers set it; default `auto`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet

from ps_bridge.kernels.gdn import plan_from_layout, prefix_shared_gated_delta_net, resolve_gdn_backend
from ps_bridge.models.packed_seq import require_prefix_layout
from ps_bridge.parallel_info import rank_tag

logger = logging.getLogger("ps_bridge")


class PrefixSharedGatedDeltaNet(GatedDeltaNet):
    def __init__(self, config, submodules, layer_number=None, pg_collection=None, **kwargs):
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection, **kwargs)
        if self.cp_size > 1:
            raise ValueError(
                f"prefix sharing does not support context parallelism in Gated DeltaNet layers (cp={self.cp_size})"
            )
        self._announced = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
        **kwargs,
    ):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("prefix-shared Gated DeltaNet has no inference (KV/state cache) path")
        layout = require_prefix_layout(packed_seq_params, "PrefixSharedGatedDeltaNet")
        qkvzba, _ = self.in_proj(hidden_states)  # [T, 1, local dims]; SP input is gathered here
        if qkvzba.dim() != 3 or qkvzba.shape[1] != 1:
            raise ValueError(f"prefix-shared Gated DeltaNet expects packed input [T, 1, hidden], got {tuple(hidden_states.shape)}")
        T = qkvzba.shape[0]
        if T != layout.num_tokens:
            raise ValueError(
                f"prefix-shared Gated DeltaNet received {T} tokens but the packed layout has {layout.num_tokens}"
            )
        qkvzba = qkvzba.squeeze(1)
        mixed_qkv, z, beta_logits, alpha = torch.split(qkvzba, self.feat_dim_split, dim=-1)
        # log decay in fp32, as HF and megatron compute it
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)
        beta = beta_logits.sigmoid()
        backend = resolve_gdn_backend(getattr(self.config, "gdn_backend", "auto"), qkvzba.device)
        if not self._announced or logger.isEnabledFor(logging.DEBUG):
            logger.info(
                "[PS][gdn][%s layer=%s] enter prefix-sharing path: backend=%s tokens=%d segments=%d groups=%d",
                rank_tag(self.pg_collection, with_cp=False), self.layer_number, backend.name,
                layout.num_tokens, layout.num_segments, layout.num_groups,
            )
            self._announced = True
        core = prefix_shared_gated_delta_net(
            mixed_qkv,
            g,
            beta,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            plan_from_layout(layout, qkvzba.device),
            backend,
            num_key_heads=self.num_k_heads_local_tp,
            key_head_dim=self.key_head_dim,
            value_head_dim=self.value_head_dim,
            use_qk_l2norm=self.use_qk_l2norm,
            activation=self.activation,
        )  # [T, HV_local, V]
        # gated output norm per value head: out_norm(o) * silu(z)
        y = self.out_norm(core.reshape(-1, self.value_head_dim))
        y = (y * F.silu(z.reshape(-1, self.value_head_dim).float())).to(core.dtype)
        return self.out_proj(y.reshape(T, 1, -1))
