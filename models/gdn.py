"""Prefix-aware Gated DeltaNet: megatron-core's `GatedDeltaNet` with forked prompt states.

Parameters, their shapes, TP sharding and sharded checkpointing are megatron-core's (this class only
replaces `forward`), so Megatron-Bridge's Qwen3.5 names apply unchanged: `in_proj.weight`,
`conv1d.weight`, `A_log`, `dt_bias`, `out_norm.weight`, `out_proj.weight`.

`forward` takes the packed THD sequence (`[T, 1, hidden]`) with the prefix layout in
`packed_seq_params` (verl's engine packs every micro-batch this way, whatever verl's data format).
The sequence mixing (causal conv1d + gated delta rule) runs the prefix
tree level by level, each node from its parent's final states: prompts first and then every
response from its prompt's (`ps_bridge.kernels.gdn`). The
backend is the config's `gdn_backend` (our providers set it; default `auto`). Under context
parallelism the layer receives this rank's shard of the pack; the conv and delta-rule inputs go to
a head shard over the whole pack and back (`models/context_parallel.py`), the decay and gate are
computed on the shard, and the conv runs with the channels of this rank's heads.
"""

from __future__ import annotations

import logging
import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from ps_bridge.kernels.gdn import gates, plan_from_layout, prefix_shared_gated_delta_net, resolve_gdn_backend
from ps_bridge.kernels.gdn.plan import bucketed_conv_tails
from ps_bridge.models.context_parallel import local_channels, to_head_shard, to_seq_shard
from ps_bridge.models.packed_seq import require_prefix_layout
from ps_bridge.parallel_info import rank_tag

logger = logging.getLogger("ps_bridge")


def bucketed_inputs(layout, conv_width: int, device) -> dict:
    """What `prefix_shared_gated_delta_net` takes for a bucketed layout (its valid tokens and the
    nodes' conv tails in the padded pack: `kernels/gdn/plan.py`); nothing for any other layout."""
    if not layout.bucketed:
        return {}
    return dict(token_mask=layout.valid.to(device), conv_tails=bucketed_conv_tails(layout, conv_width, device))


class PrefixSharedGatedDeltaNet(GatedDeltaNet):
    def __init__(self, config, submodules, layer_number=None, pg_collection=None, **kwargs):
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection, **kwargs)
        self._announced = False
        # The output norm is replicated across TP ranks but each rank normalises only its own value
        # heads, so its weight gradient is a partial sum over heads. megatron's
        # finalize_model_grads sums replicated gradients across TP only for `sequence_parallel`
        # parameters (and q/k norms), i.e. not at all with SP off (stock megatron leaves this
        # gradient partial then), and with SP on only because the flag happens to be set. We make
        # the gradient complete in the backward pass itself (`forward`), which holds with and
        # without SP and whoever finishes the gradients (our `finish_gradients` or megatron's DDP
        # in verl), so the flag must be off or SP would add the TP ranks' sums a second time.
        self._out_norm_tp_reduce = self.tp_size > 1
        if self._out_norm_tp_reduce:
            for param in self.out_norm.parameters():
                param.sequence_parallel = False

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
        S, B = qkvzba.shape[0], qkvzba.shape[1]
        if B != 1:
            raise ValueError(
                f"prefix-shared Gated DeltaNet expects packed input [T, 1, hidden], got {tuple(hidden_states.shape)}"
            )
        cp_group = self.pg_collection.cp
        cp = cp_group.size()
        if S * cp != layout.num_tokens:
            raise ValueError(
                f"prefix-shared Gated DeltaNet received {S} tokens (x context_parallel_size={cp}) but the "
                f"packed layout has {layout.num_tokens}"
            )
        plan = plan_from_layout(layout, qkvzba.device)
        what = f"tokens={layout.num_tokens} segments={layout.num_segments} groups={layout.num_groups}"
        # tokens [T, dims] in packed order
        qkvzba = qkvzba.transpose(0, 1).reshape(B * S, -1)
        # split on this rank's shard with all of the TP rank's heads (megatron's `feat_dim_split`
        # divides by the CP size: its GDN exchanges the projection before splitting it)
        qkv_dim = 2 * self.qk_dim_local_tp + self.v_dim_local_tp
        split = (qkv_dim, self.v_dim_local_tp, self.num_v_heads_local_tp, self.num_v_heads_local_tp)
        mixed_qkv, z, beta_logits, alpha = torch.split(qkvzba, split, dim=-1)
        # log decay in float32 at least, as HF and megatron compute it (float64 stays float64, so that
        # float64 runs are exact: the decay-gate gradients are checked against finite differences)
        g, beta = gates(alpha, beta_logits, self.A_log, self.dt_bias)
        qkv_sections = (self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp)
        if cp > 1:  # this rank's shard of every head -> the whole pack with 1/cp of the heads
            mixed_qkv = to_head_shard(mixed_qkv, cp_group, qkv_sections)
            g, beta = to_head_shard(g, cp_group), to_head_shard(beta, cp_group)
        backend = resolve_gdn_backend(getattr(self.config, "gdn_backend", "auto"), qkvzba.device, layout.tree_depth)
        if not self._announced or logger.isEnabledFor(logging.DEBUG):
            logger.info(
                "[PS][gdn][%s layer=%s] enter prefix-sharing path: backend=%s %s",
                rank_tag(self.pg_collection), self.layer_number, backend.name, what,
            )
            self._announced = True
        core = prefix_shared_gated_delta_net(
            mixed_qkv,
            g,
            beta,
            local_channels(self.conv1d.weight.squeeze(1), cp_group, qkv_sections),
            local_channels(self.conv1d.bias, cp_group, qkv_sections),
            plan,
            backend,
            num_key_heads=self.num_key_heads // self.tp_size // cp,  # key heads of this TP rank, per CP rank
            key_head_dim=self.key_head_dim,
            value_head_dim=self.value_head_dim,
            use_qk_l2norm=self.use_qk_l2norm,
            activation=self.activation,
            **bucketed_inputs(layout, self.conv1d.weight.shape[-1], qkvzba.device),
        )  # [T, HV_local / cp, V]
        if cp > 1:  # back to this rank's shard of every head
            core = to_seq_shard(core.reshape(core.shape[0], -1), cp_group).reshape(S, -1, self.value_head_dim)
        # gated output norm per value head: out_norm(o) * silu(z)
        y = self._out_norm(core.reshape(-1, self.value_head_dim), z.reshape(-1, self.value_head_dim))
        return self.out_proj(y.reshape(B, S, -1).transpose(0, 1).contiguous())

    def _out_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """`out_norm(x) * silu(gate)`; at TP > 1 with the norm's parameters passed through megatron's
        copy-to-TP region (identity forward, all-reduce over TP backward), so their gradients sum the
        heads of every TP rank (see `__init__`)."""
        if not self._out_norm_tp_reduce:
            return self.out_norm(x, gate)
        params = {
            name: copy_to_tensor_model_parallel_region(p, group=self.pg_collection.tp)
            for name, p in self.out_norm.named_parameters()
        }
        return torch.func.functional_call(self.out_norm, params, (x, gate))
