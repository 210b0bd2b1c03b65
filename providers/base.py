"""What every prefix-aware provider adds to a Megatron-Bridge provider.

A provider subclass changes only what prefix sharing changes: the layer spec (prefix-aware core
attention), the model class (per-token RoPE positions), the fusions that ignore per-token positions
(off, here and only here) and the parallel settings it refuses (`ParallelSettings.check_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from megatron.core.transformer.enums import AttnBackend

from ps_bridge.compat.megatron_bridge import dispatch_sources
from ps_bridge.models.gpt_model import PrefixSharedGPTModel
from ps_bridge.parallel.settings import ParallelSettings

# Fused kernels the local (non-TE) spec has not on every device, or that ignore the per-token RoPE
# table (responses continue their prompt's positions): off for every prefix-aware provider.
FUSIONS_OFF = dict(
    apply_rope_fusion=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    bias_dropout_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,  # Apex's persistent LayerNorm kernel: megatron's torch norms refuse it (Llama's bridge sets it)
)


def prepare_for_prefix_sharing(provider) -> None:
    """Before a prefix-aware provider builds its model: refuse unsupported parallel settings, turn
    the fusions off, and keep our core attention (Megatron-Bridge's provide() swaps in megatron's own
    when attention_backend is "local")."""
    ParallelSettings.from_config(provider).check_supported()
    for name, value in FUSIONS_OFF.items():
        setattr(provider, name, value)
    if getattr(provider, "attention_backend", None) == AttnBackend.local:
        provider.attention_backend = AttnBackend.auto


class PrefixSharingProviderBase:
    """Mixed into every prefix-aware provider: the fusions are off before megatron validates the config."""

    def finalize(self):
        for name, value in FUSIONS_OFF.items():
            setattr(self, name, value)
        return super().finalize()


class PrefixSharedProviderMixin(PrefixSharingProviderBase):
    """Mixed into a `GPTModelProvider` subclass (a dataclass): builds `PrefixSharedGPTModel`."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        prepare_for_prefix_sharing(self)
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        # PrefixSharedGPTModel only overrides _preprocess / _postprocess and adds no state, so re-classing the
        # stock-built GPTModel keeps Megatron-Bridge's whole construction path unchanged.
        model.__class__ = PrefixSharedGPTModel
        return model


def grouped_moe_settings(provider) -> None:
    """MoE as ps-bridge runs it: grouped experts (megatron's TEGroupedMLP on torch's grouped_mm,
    models/experts.py; TE's where TE is installed), in the grouped layout Megatron-Bridge's mappings
    convert (`experts.linear_fc1.weight<i>`), unfused permutation (its fusion needs TE), megatron's
    alltoall dispatcher on the GPU; it allocates CUDA streams at construction, so without CUDA
    allgather (which routes the same tokens to the same experts)."""
    provider.moe_grouped_gemm = True
    provider.moe_permute_fusion = False
    provider.moe_token_dispatcher_type = "alltoall" if torch.cuda.is_available() else "allgather"


@dataclass(frozen=True)
class Registration:
    """One row of a family's registration table: the only place its HF architectures are listed."""

    name: str  # our registry name (`PS_BRIDGE_PROVIDER`, `--provider`)
    source: object  # the HF architecture, as Megatron-Bridge's register_bridge takes it: class or class name
    target: type  # the Megatron model class
    provider: type  # our provider
    model_type: str  # HF model_type
    bridge: type  # our bridge

    @property
    def hf_architecture(self) -> str:
        return self.source if isinstance(self.source, str) else self.source.__name__


def register_table(rows: Sequence[Registration]) -> None:
    """Register a family's bridges with Megatron-Bridge; its dispatch takes the last registration,
    so ours replace the stock bridges of the same architectures."""
    # imported here: Megatron-Bridge is heavy, and without TE it imports only after import_megatron_bridge()
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    for row in rows:
        for source in dispatch_sources(row.source):
            MegatronModelBridge.register_bridge(
                source=source, target=row.target, provider=row.provider, model_type=row.model_type
            )(row.bridge)
