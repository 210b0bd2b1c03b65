"""Norms of the local (non-Transformer-Engine) layer spec that also work under sequence parallelism.

megatron-core's `WrappedTorchNorm` refuses `sequence_parallel=True`: under SP each TP rank
normalises only its share of the tokens, so the norm weights' gradients are partial sums that must
be added across the TP group, and megatron finds those parameters by their `sequence_parallel`
attribute. `TorchNormForSequenceParallel` builds the same torch module (`LayerNorm` / `RMSNorm`,
same parameter names, so Megatron-Bridge's mappings are unchanged) and sets that attribute.
"""

from __future__ import annotations

import torch


class TorchNormForSequenceParallel:
    """A norm builder with `WrappedTorchNorm`'s signature; returns a plain torch norm module."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("TorchNormForSequenceParallel has no zero-centred gamma; use the model family's own norm")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}: LayerNorm or RMSNorm")
        mark_sequence_parallel(norm, config)
        return norm


def mark_sequence_parallel(module: torch.nn.Module, config) -> None:
    """Tag `module`'s parameters so their gradients are summed across TP when SP is on."""
    for param in module.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
