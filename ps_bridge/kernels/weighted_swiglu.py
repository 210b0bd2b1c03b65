"""The MoE experts' probability-weighted SwiGLU: `silu(gate) * up * prob` of each routed row.

`h = [gate | up]` is the fc1 output of the routed rows `[rows, 2F]`, `prob [rows]` their router
probability (float32 from megatron's router). Over every routed row of a Qwen3.5-35B-A3B layer the
plain expression is about ten element-wise passes and a concatenation (the backward of the chunk) in
forward + backward.

- `naive`: the plain expression, as megatron's unfused `TEGroupedMLP` path computes it (bf16 products
  rounded after each op); autograd does the backward.
- `fused`: one compiled kernel forward and one backward (torch.compile on CUDA), computing in float32
  and rounding once; the backward writes the `[gate | up]` gradient whole. The same formula as
  megatron's `weighted_bias_swiglu_impl`, which is compiled at import and so stays uncompiled where
  `TORCHDYNAMO_DISABLE=1` (our CLI, our tests); ours is compiled on first use (`backend.CompiledOp`).

`weighted_swiglu` picks `fused` on CUDA and `naive` elsewhere (the CPU, Ascend NPUs: not compiled).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ps_bridge.kernels.backend import CompiledOp, runs_compiled, wide


def naive(h: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(h, 2, dim=-1)
    return (F.silu(gate) * up * prob.unsqueeze(-1)).to(h.dtype)


def _forward(h, prob):
    gate, up = wide(h).chunk(2, dim=-1)
    return (F.silu(gate) * up * prob.unsqueeze(-1)).to(h.dtype)


def _backward(grad, h, prob):
    gate, up = wide(h).chunk(2, dim=-1)
    g = wide(grad)
    s = torch.sigmoid(gate)
    silu = gate * s
    gp = g * prob.unsqueeze(-1)
    d_gate = gp * up * s * (1 + gate * (1 - s))
    d_up = gp * silu
    d_prob = (g * silu * up).sum(-1)
    return torch.cat([d_gate, d_up], dim=-1).to(h.dtype), d_prob.to(prob.dtype)


fused = CompiledOp(_forward, _backward, num_tensors=2)


def weighted_swiglu(h: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """`fused` on CUDA, `naive` elsewhere."""
    return fused(h, prob) if runs_compiled(h) else naive(h, prob)
