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
from transformers import Qwen2ForCausalLM

from ps_bridge.providers.base import PrefixSharedProviderMixin, Registration, register_table


@dataclass
class PrefixSharedQwen2Provider(PrefixSharedProviderMixin, GPTModelProvider):
    transformer_layer_spec: Union[ModuleSpec, Callable] = prefix_shared_gpt_layer_spec


class PrefixSharedQwen2Bridge(Qwen2Bridge):
    """Qwen2Bridge with our provider class; mapping and config translation inherited."""


# the only list of this family's HF architectures: registry name, HF architecture, Megatron model,
# our provider, HF model_type, our bridge
REGISTRATIONS = (
    Registration("qwen2.5", Qwen2ForCausalLM, GPTModel, PrefixSharedQwen2Provider, "qwen2", PrefixSharedQwen2Bridge),
)


def register(gdn_backend: str = "auto") -> None:
    """Register this family's bridges (Qwen2.5 has no Gated DeltaNet: `gdn_backend` is unused)."""
    register_table(REGISTRATIONS)
