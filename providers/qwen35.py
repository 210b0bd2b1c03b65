"""Qwen3.5 (dense and MoE): Megatron-Bridge's Qwen3.5 bridges with a prefix-aware provider.

What changes against Megatron-Bridge, and only that:
- the layer spec: `prefix_shared_qwen35_block_spec` (prefix-aware full attention and Gated DeltaNet,
  zero-centred RMSNorm without TE), built from the same config (`layer_types` -> pattern);
- the model class: `PrefixSharedGPTModel` (RoPE at the layout's per-token positions);
- `gdn_backend` (the run's `PrefixSharingConfig.gdn_backend`, given to the bridges when they are
  registered; default `auto`), checked when the model is built;
- no multi-token-prediction (MTP) head: it is not prefix-aware and not used for log-probs
  (transformers' Qwen3.5 classes drop it too); `mtp.*` weights are skipped;
- MoE experts grouped: megatron's `TEGroupedMLP` with grouped linears on torch's grouped_mm
  (`models/experts.py`; TE's own where TE is installed), unfused permutation (its fusion needs TE);
  the token dispatcher is megatron's `alltoall` on the GPU, `allgather` without CUDA (the stock
  `alltoall` allocates CUDA streams).

The HF <-> Megatron mapping is Megatron-Bridge's own (`Qwen35Bridge` / `Qwen35MoEBridge`), so
load, export and refit see the stock names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Union

import torch
from megatron.bridge.models.conversion.param_mapping import AutoMapping
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.models.qwen.qwen35_bridge import Qwen35Bridge, Qwen35MoEBridge
from megatron.bridge.models.qwen_vl.qwen35_vl_bridge import Qwen35VLBridge, Qwen35VLMoEBridge
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model import Qwen3VLModel
from megatron.bridge.models.qwen_vl.qwen35_vl_provider import Qwen35VLModelProvider, Qwen35VLMoEModelProvider
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from ps_bridge.compat import megatron_bridge as compat_megatron_bridge
from ps_bridge.kernels.gdn import check_gdn_backend_usable
from ps_bridge.models.moe import check_moe_settings
from ps_bridge.models.qwen35_specs import prefix_shared_qwen35_block_spec
from ps_bridge.models.qwen35_vl import PrefixSharedQwen35VLModel, PrefixSharedQwen3VLGPTModel, local_vision_tower
from ps_bridge.providers.base import (
    PrefixSharedProviderMixin,
    PrefixSharingProviderBase,
    Registration,
    grouped_moe_settings,
    prepare_for_prefix_sharing,
    register_table,
)

logger = logging.getLogger("ps_bridge")

def _build_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class PrefixSharedQwen35ProviderMixin(PrefixSharedProviderMixin):
    """Checks the GDN backend where the model is built, before any weights are allocated."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        check_gdn_backend_usable(self.gdn_backend, _build_device())
        check_moe_settings(self)
        return super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


@dataclass
class PrefixSharedQwen35Provider(PrefixSharedQwen35ProviderMixin, GPTModelProvider):
    transformer_layer_spec: Union[ModuleSpec, Callable] = prefix_shared_qwen35_block_spec
    gdn_backend: str = "auto"


def make_prefix_shared(provider, gdn_backend: str) -> None:
    """What our bridges change on the provider Megatron-Bridge's Qwen3.5 bridge configured."""
    provider.gdn_backend = gdn_backend
    if getattr(provider, "mtp_num_layers", None):
        # The multi-token-prediction head is not prefix-aware and plays no part in log-probs or
        # the policy loss; like transformers' Qwen3.5 classes (which ignore `mtp.*`), we do not
        # build it: its checkpoint weights are not loaded and not exported.
        logger.warning(
            "[PS] Qwen3.5: the checkpoint's %d multi-token-prediction layer(s) are not built with prefix "
            "sharing (their mtp.* weights are neither loaded nor exported)",
            provider.mtp_num_layers,
        )
        provider.mtp_num_layers = None
    provider.transformer_layer_spec = prefix_shared_qwen35_block_spec
    if provider.num_moe_experts:
        grouped_moe_settings(provider)


class PrefixSharedQwen35VLProviderMixin(PrefixSharingProviderBase):
    """For the ConditionalGeneration providers (`Qwen3VLModel`): our language spec, the vision tower
    unchanged (local modules where TE is absent), text positions from the layout."""

    def build_language_spec(self, vp_stage=None, pp_rank=None):
        return prefix_shared_qwen35_block_spec(self, vp_stage=vp_stage, pp_rank=pp_rank)

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        refusal = compat_megatron_bridge.vl_refusal()
        if refusal:
            raise RuntimeError(refusal)
        prepare_for_prefix_sharing(self)
        check_gdn_backend_usable(self.gdn_backend, _build_device())
        check_moe_settings(self)
        with local_vision_tower():
            model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        # only forward() differs and it adds no state: re-class the stock-built model; its language
        # model's output layer runs on the read positions only (adds no state either)
        model.__class__ = PrefixSharedQwen35VLModel
        compat_megatron_bridge.exact_gelu_merger(model)
        if model.language_model is not None:
            model.language_model.__class__ = PrefixSharedQwen3VLGPTModel
        return model


@dataclass
class PrefixSharedQwen35VLProvider(PrefixSharedQwen35VLProviderMixin, Qwen35VLModelProvider):
    gdn_backend: str = "auto"


@dataclass
class PrefixSharedQwen35VLMoEProvider(PrefixSharedQwen35VLProviderMixin, Qwen35VLMoEModelProvider):
    gdn_backend: str = "auto"


class PrefixSharedQwen35BridgeMixin:
    """Our bridges: Megatron-Bridge's Qwen3.5 bridge (mapping and config translation), then what
    prefix sharing changes on the provider it configured. `gdn_backend` is set by `register`."""

    gdn_backend: str = "auto"
    vl_provider_class: type = None  # the VL bridges instantiate their provider class directly

    def provider_bridge(self, hf_pretrained):
        provider = super().provider_bridge(hf_pretrained)
        compat_megatron_bridge.exact_attention_pattern(provider, hf_pretrained.config)
        if self.vl_provider_class is not None:
            provider.__class__ = self.vl_provider_class  # our subclass only adds methods and gdn_backend
        make_prefix_shared(provider, self.gdn_backend)
        return provider

    def mapping_registry(self):
        return compat_megatron_bridge.experts_as_stored(super().mapping_registry(), getattr(self, "hf_pretrained", None))


class PrefixSharedQwen35Bridge(PrefixSharedQwen35BridgeMixin, Qwen35Bridge):
    pass


class PrefixSharedQwen35MoEBridge(PrefixSharedQwen35BridgeMixin, Qwen35MoEBridge):
    pass


class PrefixSharedQwen35VLBridge(PrefixSharedQwen35BridgeMixin, Qwen35VLBridge):
    vl_provider_class = PrefixSharedQwen35VLProvider


class PrefixSharedQwen35VLMoEBridge(PrefixSharedQwen35BridgeMixin, Qwen35VLMoEBridge):
    vl_provider_class = PrefixSharedQwen35VLMoEProvider


def _registrations():
    # the only list of this family's HF architectures: registry name, HF architecture, Megatron
    # model, our provider, HF model_type, our bridge
    return (
        Registration("qwen3.5", "Qwen3_5ForCausalLM", GPTModel, PrefixSharedQwen35Provider, "qwen3_5_text", PrefixSharedQwen35Bridge),
        Registration("qwen3.5", "Qwen3_5ForConditionalGeneration", Qwen3VLModel, PrefixSharedQwen35VLProvider, "qwen3_5", PrefixSharedQwen35VLBridge),
        Registration("qwen3.5-moe", "Qwen3_5MoeForCausalLM", GPTModel, PrefixSharedQwen35Provider, "qwen3_5_moe_text", PrefixSharedQwen35MoEBridge),
        Registration("qwen3.5-moe", "Qwen3_5MoeForConditionalGeneration", Qwen3VLModel, PrefixSharedQwen35VLMoEProvider, "qwen3_5_moe", PrefixSharedQwen35VLMoEBridge),
    )


REGISTRATIONS = _registrations()


def register(gdn_backend: str = "auto") -> None:
    """Register this family's bridges; the providers they build use `gdn_backend`."""
    # Megatron-Bridge picks the TP split of an AutoMapping from the owning module's class name;
    # ours get the kinds of the classes they stand in for (megatron's norms, GatedDeltaNet)
    AutoMapping.register_module_type("ZeroCenteredRMSNorm", "replicated")
    AutoMapping.register_module_type("PrefixSharedGatedDeltaNet", "column")
    AutoMapping.register_module_type("PrefixSharedTopKRouter", "replicated")
    AutoMapping.register_module_type("GroupedMMColumnLinear", "column")
    AutoMapping.register_module_type("GroupedMMRowLinear", "row")
    PrefixSharedQwen35BridgeMixin.gdn_backend = gdn_backend
    register_table(REGISTRATIONS)
