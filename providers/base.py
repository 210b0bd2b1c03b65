"""What every prefix-aware provider adds to a Megatron-Bridge provider.

A provider subclass changes only what prefix sharing changes: the layer spec (prefix-aware core
attention), the model class (per-token RoPE positions) and the parallel settings it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps_bridge.models.gpt_model import PrefixSharedGPTModel


def check_parallel_settings(config) -> None:
    """Refuse, when the model is built, the parallel settings prefix sharing does not support."""
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1:
        raise ValueError(
            f"prefix sharing does not support context parallelism: context_parallel_size={cp}; "
            "set context_parallel_size=1 (TP, sequence parallelism and physical PP are supported)"
        )
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vpp is not None and vpp > 1:
        raise ValueError(
            f"prefix sharing does not support virtual pipeline stages: "
            f"virtual_pipeline_model_parallel_size={vpp}; leave it unset (physical PP is supported)"
        )


class PrefixSharedProviderMixin:
    """Mixed into a `GPTModelProvider` subclass (a dataclass): builds `PrefixSharedGPTModel`."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        check_parallel_settings(self)
        # Megatron-Bridge's provide() swaps in megatron's own core attention when
        # attention_backend is "local"; our spec must keep its prefix-aware core attention.
        from megatron.core.transformer.enums import AttnBackend

        if self.attention_backend == AttnBackend.local:
            self.attention_backend = AttnBackend.auto
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        # PrefixSharedGPTModel only overrides _preprocess and adds no state, so re-classing the
        # stock-built GPTModel keeps Megatron-Bridge's whole construction path unchanged.
        model.__class__ = PrefixSharedGPTModel
        return model
