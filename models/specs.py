"""Layer specs: megatron-core's local GPT layer with the prefix-aware core attention swapped in."""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from ps_bridge.models.attention import PrefixSharedCoreAttention
from ps_bridge.models.norms import TorchNormForSequenceParallel


def with_sequence_parallel_norms(spec):
    """Replace megatron's `WrappedTorchNorm` (which refuses sequence parallelism) by
    `TorchNormForSequenceParallel` everywhere in a spec tree (a layer `ModuleSpec` or a
    `TransformerBlockSubmodules`, e.g. a hybrid family's block); other norms (TE, Apex, a family's
    own) are left alone and must mark their parameters `sequence_parallel` themselves."""
    if spec is WrappedTorchNorm:
        return TorchNormForSequenceParallel
    if isinstance(spec, list):  # TransformerBlockSubmodules.layer_specs
        return [with_sequence_parallel_norms(item) for item in spec]
    if isinstance(spec, ModuleSpec):
        if spec.submodules is not None:
            spec.submodules = with_sequence_parallel_norms(spec.submodules)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, with_sequence_parallel_norms(getattr(spec, f.name)))
    return spec


def block_spec_for_sequence_parallel(layer_spec: ModuleSpec, config, vp_stage=None) -> TransformerBlockSubmodules:
    """The block megatron would build from `layer_spec` (this stage's layers, then the final norm),
    with norms that accept sequence parallelism. Family-agnostic: any local layer spec fits."""
    layer_spec = with_sequence_parallel_norms(layer_spec)
    final_norm = TorchNormForSequenceParallel if LayerNormImpl is WrappedTorchNorm else LayerNormImpl
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=final_norm)


def prefix_shared_gpt_layer_spec(config, vp_stage=None) -> TransformerBlockSubmodules:
    """Qwen2.5-style decoder layers (RMSNorm, GQA attention, gated MLP) with prefix-shared attention."""
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    spec.submodules.self_attention.submodules.core_attention = PrefixSharedCoreAttention
    return block_spec_for_sequence_parallel(spec, config, vp_stage)
