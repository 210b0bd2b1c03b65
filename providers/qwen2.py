"""Qwen2 / Qwen2.5: Megatron-Bridge's Qwen2 bridge and GPT provider, prefix-aware.

The HF <-> Megatron parameter mapping is Megatron-Bridge's own `Qwen2Bridge.mapping_registry`,
unchanged: loading, export and refit see the same names and shapes as the stock bridge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.models.qwen.qwen2_bridge import Qwen2Bridge
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from ps_bridge.models.specs import prefix_shared_gpt_layer_spec
from ps_bridge.providers.base import PrefixSharedProviderMixin

HF_ARCHITECTURES = ("Qwen2ForCausalLM",)


@dataclass
class PrefixSharedQwen2Provider(PrefixSharedProviderMixin, GPTModelProvider):
    transformer_layer_spec: Union[ModuleSpec, Callable] = prefix_shared_gpt_layer_spec
    # the local spec has no fused bias+activation / rope kernels on every device
    apply_rope_fusion: bool = False
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    bias_dropout_fusion: bool = False
    gradient_accumulation_fusion: bool = False


class PrefixSharedQwen2Bridge(Qwen2Bridge):
    """Qwen2Bridge with our provider class; mapping and config translation inherited."""


def register() -> None:
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from transformers import Qwen2ForCausalLM

    MegatronModelBridge.register_bridge(
        source=Qwen2ForCausalLM, target=GPTModel, provider=PrefixSharedQwen2Provider, model_type="qwen2"
    )(PrefixSharedQwen2Bridge)
