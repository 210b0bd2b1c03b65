"""Norms that need no Transformer Engine.

- `TorchNormForSequenceParallel`: megatron-core's `WrappedTorchNorm` refuses `sequence_parallel=True`:
  under SP each TP rank normalises only its share of the tokens, so the norm weights' gradients are
  partial sums that must be added across the TP group, and megatron finds those parameters by their
  `sequence_parallel` attribute. This builds the same torch module (`LayerNorm` / `RMSNorm`, same
  parameter names, so Megatron-Bridge's mappings are unchanged) and sets that attribute.
- `ZeroCenteredRMSNorm` (Qwen3.5): the scale is `1 + w` (HF `Qwen3_5RMSNorm` computes
  `rmsnorm(x.float()) * (1 + w.float())`, weights initialised to 0). Megatron expresses the same
  with `layernorm_zero_centered_gamma=True`, and Megatron-Bridge's Qwen3.5 mapping copies the weights
  unchanged (AutoMapping) for the decoder norms and q/k norms, and subtracts 1 for the GDN output
  norm, whose HF weight is a plain scale. megatron-core's local `WrappedTorchNorm` refuses
  zero-centred gamma and TE's norm is not available everywhere. Its parameter is called `weight`,
  like megatron's norms, so Megatron-Bridge's names apply (`input_layernorm.weight`,
  `self_attention.q_layernorm.weight`, `self_attention.out_norm.weight`, ...). It computes with
  `ps_bridge.kernels.rms_norm` (fused on CUDA).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ps_bridge.kernels.rms_norm import gated_rms_norm, rms_norm


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

class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"ZeroCenteredRMSNorm implements RMSNorm only, config asks for {config.normalization}")
        if not getattr(config, "layernorm_zero_centered_gamma", True):
            raise ValueError("ZeroCenteredRMSNorm needs layernorm_zero_centered_gamma=True in the config")
        self.eps = eps
        self.weight = nn.Parameter(
            torch.zeros(hidden_size, dtype=config.params_dtype)
        )
        # with sequence parallelism each rank sees a shard of the tokens: the weight gradient must be
        # all-reduced over the TP group, which megatron does for parameters flagged like this
        setattr(self.weight, "sequence_parallel", bool(getattr(config, "sequence_parallel", False)))

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The norm of `x`; with `gate` (Gated DeltaNet's output norm) times `silu(gate)`, in one kernel."""
        if gate is None:
            return rms_norm(x, self.weight, self.eps, zero_centered=True)
        return gated_rms_norm(x, self.weight, gate, self.eps, zero_centered=True)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered_gamma=True"
