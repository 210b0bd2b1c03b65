"""Layer specs of prefix-aware Qwen3.5 (no Transformer Engine needed).

Per layer, the attention kind comes from the config's `linear_attention_freq` (Megatron-Bridge sets
it to the HF `layer_types` list: 1 = Gated DeltaNet, 0 = full attention) and the MLP kind from
`moe_layer_freq` (dense or MoE), as in megatron-core's hybrid spec, whose TE-only assertion we avoid:

- full attention: megatron's `SelfAttention` (attention_output_gate, q/k norm and partial RoPE
  come from the config) with our prefix-aware core attention;
- Gated DeltaNet: our `PrefixSharedGatedDeltaNet`;
- MoE layers: megatron's local MoE with `PrefixSharedTopKRouter` (aux-loss token weights), in a
  `PrefixSharedMoETransformerLayer` that passes the micro-batch's token weights to the router;
  experts grouped (`moe_grouped_gemm=True`: megatron's `TEGroupedMLP` with `models/experts.py`'s
  grouped_mm linears, TE's where TE is installed) or megatron's `SequentialMLP` (False);
- every norm (input, pre-MLP, q/k, GDN out-norm, final) is our zero-centred RMSNorm; the input norm
  is a separate module (`input_layernorm.weight`), which Megatron-Bridge maps to HF's
  `input_layernorm.weight` through its fused/separate norm aliases;
- sharded checkpoint keys are megatron's local spec's (`sharded_state_dict_keys_map`: the input norm
  saved as `self_attention.linear_qkv.layer_norm_weight`, the pre-MLP norm as
  `mlp.linear_fc1.layer_norm_weight`), except a GDN layer's input norm: `self_attention.in_proj.
  layer_norm_weight`, megatron's GDN key (docs/checkpoints.md).
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern,
    get_moe_layer_pattern,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from ps_bridge.models.attention import PrefixSharedCoreAttention
from ps_bridge.models.experts import grouped_experts_spec
from ps_bridge.models.gdn import PrefixSharedGatedDeltaNet
from ps_bridge.models.moe import PrefixSharedMoETransformerLayer, PrefixSharedTopKRouter
from ps_bridge.models.norms import ZeroCenteredRMSNorm
from ps_bridge.models.specs import with_moe_submodules


def _layer_spec(config, moe: bool, gdn: bool) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts if moe else None,
        moe_grouped_gemm=config.moe_grouped_gemm if moe else False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.input_layernorm = ZeroCenteredRMSNorm
    sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    if moe:
        # prompt tokens weighted by their group size in the load-balancing statistics; the layer
        # hands the micro-batch's token weights to its MoE layer for the call (recompute included)
        spec.module = PrefixSharedMoETransformerLayer
        changes = {"router": PrefixSharedTopKRouter}
        if config.moe_grouped_gemm:  # megatron's TEGroupedMLP on torch's grouped_mm (TE's where installed)
            changes["experts"] = grouped_experts_spec()
        sub.mlp = with_moe_submodules(sub.mlp, **changes)
    if gdn:
        sub.self_attention = ModuleSpec(
            module=PrefixSharedGatedDeltaNet,
            submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear
            ),
        )
        # megatron's GDN fuses the input norm into `in_proj` (its TE spec; it has no local one): the
        # sharded checkpoint key of our separate input norm is that fused norm's
        sub.sharded_state_dict_keys_map = dict(sub.sharded_state_dict_keys_map,
                                               **{"input_layernorm.": "self_attention.in_proj.layer_norm_"})
    else:
        attn = sub.self_attention.submodules
        attn.core_attention = PrefixSharedCoreAttention
        attn.q_layernorm = ZeroCenteredRMSNorm
        attn.k_layernorm = ZeroCenteredRMSNorm
    return spec


def prefix_shared_qwen35_block_spec(config, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage (physical PP; virtual PP is refused by the provider)."""
    gdn_pattern = get_linear_attention_pattern(config)
    moe_pattern = get_moe_layer_pattern(config) if config.num_moe_experts else [0] * config.num_layers
    kinds = {}
    layer_specs = []
    for i in range(config.num_layers):
        key = (bool(moe_pattern[i]), bool(gdn_pattern[i]))
        if key not in kinds:
            kinds[key] = _layer_spec(config, moe=key[0], gdn=key[1])
        layer_specs.append(kinds[key])
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset : offset + count], layer_norm=ZeroCenteredRMSNorm)
