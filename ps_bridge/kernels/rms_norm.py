"""RMSNorm over the last dimension: `x * rsqrt(mean(x^2) + eps) * scale`, computed in float32 (float64
stays float64) and rounded once to the input's dtype; `scale` is `1 + w` where the norm is zero-centred
(Qwen3.5's `Qwen3_5RMSNorm`, megatron's `layernorm_zero_centered_gamma`), else `w`.

- `naive`: the plain expression; autograd does the backward. Without Transformer Engine this is what
  megatron-core's local norms amount to: about eight element-wise and reduction passes forward and
  more backward, each reading and writing float32 tensors of the input's size (element-wise and
  reduction kernels are a fifth of the GPU time of the Qwen3.5-35B-A3B bench step on an H200:
  docs/bench/profile-moe-35b-a3b-g4-h200-2026-12-04.md).
- `_backward`: the gradients in one pass, which the Triton kernel computes (`row_norm.py`: one kernel
  forward, one backward, the same float32 arithmetic and the same single rounding); it recomputes the
  row's `rsqrt` instead of saving it:
      dx = r * g s - x r^3 mean(g s x),   dw = sum over rows of g x r   (r = rsqrt(mean(x^2) + eps)).

`gated_rms_norm` is Gated DeltaNet's output norm, `rms_norm(x) * silu(gate)`: the norm rounded to the
input's dtype (as the norm module returns it), times `silu` of the gate in float32, rounded once more; its
backward (`_gated_backward`, the kernel's) keeps the norm's output gradient in float32 (one rounding fewer
than autograd through the plain expression, which rounds it to the norm's dtype):
    d(norm) = g silu(z),   dz = g norm sigma(z) (1 + z (1 - sigma(z))).

`rms_norm` and `gated_rms_norm` run the Triton kernel where it runs (`row_norm.usable`: CUDA) and
`naive` elsewhere (the CPU, Ascend NPUs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ps_bridge.kernels import row_norm
from ps_bridge.kernels.backend import wide


def _scale(weight: torch.Tensor, zero_centered: bool, dtype: torch.dtype) -> torch.Tensor:
    w = weight.to(dtype)  # the input's computing dtype: float32, or float64 for a float64 input
    return 1.0 + w if zero_centered else w


def naive(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    xf = wide(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * _scale(weight, zero_centered, xf.dtype)).to(x.dtype)


def _rms_backward(dy, xf, r, s):
    """The norm's input and weight gradients (in `xf`'s dtype) from its output gradient `dy`."""
    gs = dy * s
    dx = r * gs - xf * (r * r * r) * (gs * xf).mean(-1, keepdim=True)
    dw = (dy * xf * r).reshape(-1, xf.shape[-1]).sum(0)
    return dx, dw


def _backward(grad, x, weight, eps: float, zero_centered: bool):
    xf = wide(x)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    dx, dw = _rms_backward(grad.to(xf.dtype), xf, r, _scale(weight, zero_centered, xf.dtype))
    return dx.to(x.dtype), dw.to(weight.dtype)


def naive_gated(x, weight, gate, eps: float, zero_centered: bool) -> torch.Tensor:
    y = naive(x, weight, eps, zero_centered)
    return (wide(y) * F.silu(wide(gate))).to(x.dtype)


def _gated_backward(grad, x, weight, gate, eps: float, zero_centered: bool):
    xf, zf = wide(x), wide(gate)
    g = grad.to(xf.dtype)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    s = _scale(weight, zero_centered, xf.dtype)
    y = (xf * r * s).to(x.dtype).to(xf.dtype)  # the norm's output as the forward rounded it
    sig = torch.sigmoid(zf)
    dz = g * y * sig * (1.0 + zf * (1.0 - sig))
    dx, dw = _rms_backward(g * (zf * sig), xf, r, s)
    return dx.to(x.dtype), dw.to(weight.dtype), dz.to(gate.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """The Triton kernel where it runs (`row_norm.usable`), `naive` elsewhere."""
    if row_norm.usable(x):
        return row_norm.RowNorm.apply(x, weight, None, eps, True, zero_centered)
    return naive(x, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """`rms_norm(x, weight, eps, zero_centered) * silu(gate)`: the Triton kernel where it runs, `naive_gated` elsewhere."""
    if row_norm.usable(x):
        return row_norm.RowNorm.apply(x, weight, gate, eps, True, zero_centered)
    return naive_gated(x, weight, gate, eps, zero_centered)
