"""Standard-attention GPT families: Megatron-Bridge's own bridge, our layer spec, one table row each.

A family whose Megatron-Bridge bridge builds a plain `GPTModel` with standard self-attention (GQA,
MQA or MHA; optional q/k norm per head and q/k/v bias; any head dim) and a dense or MoE MLP is
served by `registry.STANDARD_FAMILIES` (name, HF architecture, HF model_type, the stock bridge);
this module makes each row a bridge and a provider. What changes against the stock bridge, and only that:

- the layer spec: `prefix_shared_gpt_block_spec` (models/specs.py), built from the same config;
- the model class: `PrefixSharedGPTModel` (RoPE at the layout's per-token positions, the output
  layer on the read positions);
- MoE: grouped experts and megatron's alltoall dispatcher (allgather without CUDA), unfused
  permutation, as for Qwen3.5 MoE; dense layers among MoE layers (HF `mlp_only_layers`,
  `decoder_sparse_step`) become megatron's per-layer `moe_layer_freq`, their MLP mapped by
  Megatron-Bridge's own `GatedMLPMapping` / `AutoMapping` where the stock mapping has none;
- RoPE `llama3` scaling with the checkpoint's own `low_freq_factor`, `high_freq_factor` and
  `original_max_position_embeddings` (compat/megatron_bridge.py: megatron-core fixes them);
- no multi-token-prediction head (not prefix-aware, not used for log-probs);
- refused by name: what the standard path would compute wrong (multi-latent attention, sliding
  windows, attention sinks, gated or experimental attention, RoPE types other than default /
  linear / llama3).

The HF <-> Megatron mapping is the stock bridge's, so load, export and refit see the stock names.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Union

from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from ps_bridge.compat import megatron_bridge as compat_megatron_bridge
from ps_bridge.models.moe import check_moe_settings
from ps_bridge.models.specs import prefix_shared_gpt_block_spec
from ps_bridge.providers.base import PrefixSharedProviderMixin, Registration, grouped_moe_settings, register_table
from ps_bridge.providers.registry import STANDARD_FAMILIES

logger = logging.getLogger("ps_bridge")

# RoPE types the standard path computes exactly at per-token positions: plain, linear interpolation
# (megatron's `seq_len_interpolation_factor`, applied by the per-token table) and llama3 (its inverse
# frequencies, set by the provider)
ROPE_TYPES = ("default", "linear", "llama3")


class NonStandardAttentionError(ValueError):
    """The checkpoint's attention is not what the standard-attention path computes."""


def _attention_refusal(provider, hf_config, family: str) -> Optional[str]:
    """Why `family`'s checkpoint (its HF config, and the provider the stock bridge configured from
    it) cannot run on the standard-attention path, or None."""
    layer_types = getattr(hf_config, "layer_types", None) or ()
    if getattr(provider, "multi_latent_attention", False) or getattr(hf_config, "kv_lora_rank", None):
        return "multi-latent attention (MLA)"
    sliding = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    if sliding or any(t != "full_attention" for t in layer_types) or getattr(provider, "window_size", None):
        kinds = sorted(set(layer_types) - {"full_attention"})
        return f"sliding-window attention (sliding_window={sliding}, layer_types {kinds or 'none'})"
    if getattr(provider, "softmax_type", "vanilla") != "vanilla" or getattr(hf_config, "attention_sinks", None):
        return f"attention sinks (softmax_type={getattr(provider, 'softmax_type', None)!r})"
    if getattr(provider, "attention_output_gate", False) or getattr(provider, "experimental_attention_variant", None):
        return "gated or experimental attention (attention_output_gate / experimental_attention_variant)"
    rope_type = compat_megatron_bridge.hf_rope_type(hf_config)
    if rope_type not in ROPE_TYPES:
        return f"RoPE scaling {rope_type!r} (the standard path honours {', '.join(ROPE_TYPES)})"
    return None


def refuse_nonstandard_attention(provider, hf_config, family: str) -> None:
    problem = _attention_refusal(provider, hf_config, family)
    if problem:
        raise NonStandardAttentionError(
            f"the {family!r} checkpoint uses {problem}, which ps-bridge's standard-attention path does not "
            "compute (its log-probs would be wrong). Fix: a checkpoint with full causal softmax attention, or a "
            f"provider written for this attention (ps-bridge providers: see `ps-bridge doctor`)"
        )


def _moe_layer_pattern(hf_config):
    """Megatron's per-layer MoE pattern (1 = MoE) from HF's `mlp_only_layers` / `decoder_sparse_step`
    (Qwen2-MoE / Qwen3-MoE convention: layer i is MoE unless listed, and only where (i + 1) divides by
    the step), or None where every layer is MoE."""
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(int(hf_config.num_hidden_layers))]
    return None if all(pattern) else pattern


@dataclass
class PrefixSharedGPTProvider(PrefixSharedProviderMixin, GPTModelProvider):
    transformer_layer_spec: Union[ModuleSpec, Callable] = prefix_shared_gpt_block_spec
    # llama3 RoPE scaling (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    llama3_rope: Optional[tuple] = None

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        check_moe_settings(self)
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if self.llama3_rope is not None and getattr(model, "rotary_pos_emb", None) is not None:
            rope = model.rotary_pos_emb
            rope.inv_freq = compat_megatron_bridge.llama3_inv_freq(
                rope.inv_freq.numel() * 2, float(self.rotary_base), *self.llama3_rope
            ).to(rope.inv_freq.device)
        return model


class PrefixSharedGPTBridgeMixin:
    """Put before a stock Megatron-Bridge bridge: its mapping and config translation, then what
    prefix sharing changes on the provider it configured. `family` is set per registered class."""

    family: str = ""

    def provider_bridge(self, hf_pretrained):
        provider = super().provider_bridge(hf_pretrained)
        hf_config = hf_pretrained.config
        refuse_nonstandard_attention(provider, hf_config, self.family)
        provider.__class__ = PrefixSharedGPTProvider  # adds methods and defaulted fields only
        provider.transformer_layer_spec = prefix_shared_gpt_block_spec
        provider.llama3_rope = compat_megatron_bridge.llama3_rope_parameters(hf_config)
        linear = compat_megatron_bridge.linear_rope_factor(hf_config)
        if linear is not None:  # megatron's per-token table divides the positions by it
            provider.seq_len_interpolation_factor = linear
        compat_megatron_bridge.router_softmax_from_config(provider, hf_config)
        if getattr(provider, "mtp_num_layers", None):
            logger.warning(
                "[PS] %s: the checkpoint's %d multi-token-prediction layer(s) are not built with prefix sharing "
                "(their mtp.* weights are neither loaded nor exported)", self.family, provider.mtp_num_layers,
            )
            provider.mtp_num_layers = None
        if provider.num_moe_experts:
            grouped_moe_settings(provider)
            pattern = _moe_layer_pattern(hf_config)
            if pattern is not None:
                provider.moe_layer_freq = pattern
        return provider

    def mapping_registry(self):
        registry = super().mapping_registry()
        pretrained = getattr(self, "hf_pretrained", None)  # a HF wrapper or a bare config
        config = getattr(pretrained, "config", pretrained)
        if config is None or not getattr(config, "num_experts", None) or _moe_layer_pattern(config) is None:
            return registry
        return _with_dense_mlp_mappings(registry)


def _with_dense_mlp_mappings(registry):
    """`registry` plus the dense MLP of layers among MoE layers (HF `mlp.gate_proj` / `up_proj` /
    `down_proj`), where the stock mapping (written for all-MoE models) has none."""
    names = {m.megatron_param for m in registry.mappings}
    extra = []
    if "decoder.layers.*.mlp.linear_fc1.weight" not in names:
        extra.append(GatedMLPMapping(megatron_param="decoder.layers.*.mlp.linear_fc1.weight",
                                     gate="model.layers.*.mlp.gate_proj.weight", up="model.layers.*.mlp.up_proj.weight"))
    if "decoder.layers.*.mlp.linear_fc2.weight" not in names:
        extra.append(AutoMapping(megatron_param="decoder.layers.*.mlp.linear_fc2.weight",
                                 hf_param="model.layers.*.mlp.down_proj.weight"))
    return MegatronMappingRegistry(*registry.mappings, *extra) if extra else registry


def _stock_bridge(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _registrations():
    rows = []
    for family in STANDARD_FAMILIES:
        stock = _stock_bridge(family.stock_bridge)
        bridge = type(f"PrefixShared{stock.__name__}", (PrefixSharedGPTBridgeMixin, stock),
                      {"family": family.name, "__module__": __name__})
        rows.append(Registration(family.name, family.hf_architecture, GPTModel, PrefixSharedGPTProvider,
                                 family.model_type, bridge))
    return tuple(rows)


REGISTRATIONS = _registrations()


def register(gdn_backend: str = "auto") -> None:
    """Register the standard families' bridges (no Gated DeltaNet: `gdn_backend` is unused)."""
    # Megatron-Bridge picks the TP split of an AutoMapping from the owning module's class name
    AutoMapping.register_module_type("PrefixSharedTopKRouter", "replicated")
    AutoMapping.register_module_type("GroupedMMColumnLinear", "column")
    AutoMapping.register_module_type("GroupedMMRowLinear", "row")
    register_table(REGISTRATIONS)


__all__ = ["PrefixSharedGPTProvider", "PrefixSharedGPTBridgeMixin", "NonStandardAttentionError", "REGISTRATIONS",
           "register", "refuse_nonstandard_attention"]
