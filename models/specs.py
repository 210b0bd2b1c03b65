"""Layer specs: megatron-core's local GPT layer with the prefix-aware core attention swapped in.

`prefix_shared_gpt_block_spec` is the one spec of the standard-attention families
(`providers/gpt.py`): megatron's local layer as the config describes it (RMSNorm or LayerNorm, q/k
norm per head where `qk_layernorm`, q/k/v bias where `add_qkv_bias`, any `kv_channels`), our core
attention, and per layer a dense MLP or a MoE layer (`moe_layer_freq`) with the router statistics
weighted by token multiplicity and grouped experts.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from ps_bridge.models.attention import PrefixSharedCoreAttention
from ps_bridge.models.experts import grouped_experts_spec
from ps_bridge.models.moe import PrefixSharedMoELayer, PrefixSharedMoETransformerLayer, PrefixSharedTopKRouter
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


def with_moe_submodules(mlp, **changes):
    """Our MoE layer spec from megatron's (a ModuleSpec, or a functools.partial of MoELayer):
    `PrefixSharedMoELayer` with `changes` to its submodules (router, experts)."""
    if isinstance(mlp, functools.partial):
        submodules = copy.copy(mlp.keywords["submodules"])
        for k, v in changes.items():
            setattr(submodules, k, v)
        return functools.partial(PrefixSharedMoELayer, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    mlp = copy.copy(mlp)
    mlp.module = PrefixSharedMoELayer
    mlp.submodules = copy.copy(mlp.submodules)
    for k, v in changes.items():
        setattr(mlp.submodules, k, v)
    return mlp


def prefix_shared_moe_layer(spec: ModuleSpec, config) -> ModuleSpec:
    """A local MoE layer spec made prefix-aware: the transformer layer hands the micro-batch's token
    weights (a prompt token counts once per sample through it) to `PrefixSharedTopKRouter`; experts
    grouped where `moe_grouped_gemm` (megatron's TEGroupedMLP on torch's grouped_mm, TE's where installed)."""
    spec.module = PrefixSharedMoETransformerLayer
    changes = {"router": PrefixSharedTopKRouter}
    if config.moe_grouped_gemm:
        changes["experts"] = grouped_experts_spec()
    spec.submodules.mlp = with_moe_submodules(spec.submodules.mlp, **changes)
    return spec


def _standard_layer_spec(config, moe: bool) -> ModuleSpec:
    spec = copy.deepcopy(get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts if moe else None,
        moe_grouped_gemm=bool(config.moe_grouped_gemm) if moe else False,
        qk_layernorm=bool(config.qk_layernorm),
        normalization=config.normalization,
    ))
    spec.submodules.self_attention.submodules.core_attention = PrefixSharedCoreAttention
    return prefix_shared_moe_layer(spec, config) if moe else spec


def prefix_shared_gpt_block_spec(config, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder block of a standard-attention GPT family: per layer a dense or
    a MoE layer (megatron's `moe_layer_freq` pattern: an int period or a per-layer 0/1 list), then
    the final norm; norms that accept sequence parallelism."""
    moe_pattern = get_moe_layer_pattern(config) if config.num_moe_experts else [0] * config.num_layers
    kinds = {moe: _standard_layer_spec(config, moe) for moe in sorted({bool(m) for m in moe_pattern})}
    layer_specs = [kinds[bool(m)] for m in moe_pattern]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    final_norm = TorchNormForSequenceParallel if LayerNormImpl is WrappedTorchNorm else LayerNormImpl
    return with_sequence_parallel_norms(
        TransformerBlockSubmodules(layer_specs=layer_specs[offset : offset + count], layer_norm=final_norm)
    )
