"""RMSNorm over the last dimension: `x * rsqrt(mean(x^2) + eps) * scale`, computed in float32 (float64
stays float64) and rounded once to the input's dtype; `scale` is `1 + w` where the norm is zero-centred
(Qwen3.5's `Qwen3_5RMSNorm`, megatron's `layernorm_zero_centered_gamma`), else `w`.

- `naive`: the plain expression; autograd does the backward. Without Transformer Engine this is what
  megatron-core's local norms amount to: about eight element-wise and reduction passes forward and
  more backward, each reading and writing float32 tensors of the input's size (element-wise and
  reduction kernels are a fifth of the GPU time of the Qwen3.5-35B-A3B bench step on an H200:
  docs/bench/profile-moe-35b-a3b-g4-h200-2026-12-04.md).
- `fused`: one compiled kernel forward and one backward (torch.compile on CUDA, the row count
  dynamic), the same float32 arithmetic and the same single rounding; the backward recomputes the
  row's `rsqrt` instead of saving it and returns the input's and the weight's gradients:
      dx = r * g s - x r^3 mean(g s x),   dw = sum over rows of g x r   (r = rsqrt(mean(x^2) + eps)).

`rms_norm` picks `fused` on CUDA and `naive` elsewhere (the CPU, Ascend NPUs: not compiled).
"""

from __future__ import annotations

import functools

import torch

from ps_bridge.kernels.backend import compile_allowed, wide


def _scale(weight: torch.Tensor, zero_centered: bool, dtype: torch.dtype) -> torch.Tensor:
    w = weight.to(dtype)  # the input's computing dtype: float32, or float64 for a float64 input
    return 1.0 + w if zero_centered else w


def naive(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    xf = wide(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * _scale(weight, zero_centered, xf.dtype)).to(x.dtype)


def _backward(grad, x, weight, eps: float, zero_centered: bool):
    xf = wide(x)
    g = grad.to(xf.dtype)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gs = g * _scale(weight, zero_centered, xf.dtype)
    dx = r * gs - xf * (r * r * r) * (gs * xf).mean(-1, keepdim=True)
    dw = (g * xf * r).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@functools.lru_cache(maxsize=None)
def _compiled():
    with compile_allowed():  # dynamic: the token count changes with every micro-batch
        return torch.compile(naive, dynamic=True), torch.compile(_backward, dynamic=True)


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.zero_centered = eps, zero_centered
        return _compiled()[0](x, weight, eps, zero_centered)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dw = _compiled()[1](grad.contiguous(), x, weight, ctx.eps, ctx.zero_centered)
        return dx, dw, None, None


def fused(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    return _Fused.apply(x.contiguous(), weight, eps, zero_centered)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """`fused` on CUDA, `naive` elsewhere."""
    return fused(x, weight, eps, zero_centered) if x.is_cuda else naive(x, weight, eps, zero_centered)
