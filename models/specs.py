"""Layer specs: megatron-core's local GPT layer with the prefix-aware core attention swapped in."""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from ps_bridge.models.attention import PrefixSharedCoreAttention


def prefix_shared_gpt_layer_spec(config) -> ModuleSpec:
    """Qwen2.5-style decoder layer (RMSNorm, GQA attention, gated MLP) with prefix-shared attention."""
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    spec.submodules.self_attention.submodules.core_attention = PrefixSharedCoreAttention
    return spec
