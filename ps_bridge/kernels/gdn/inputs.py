"""Gated DeltaNet's per-token inputs besides q, k, v: the log decay `g` and the write strength `beta`
from the input projection, and the l2 norm of q and k after the conv.

- `naive_gates`: `g = -exp(A_log) * softplus(alpha + dt_bias)` in float32 at least (float64 stays
  float64), as HF's and megatron's Gated DeltaNet compute it, and `beta = sigmoid(b)` in b's dtype.
- `naive_l2_normalize`: `x * rsqrt(sum(x^2) + eps)` over the last dimension, in float32 at least and
  rounded once (fla's and HF's l2norm).
- On CUDA the same arithmetic and roundings as one Triton kernel forward and one backward: the gates
  `triton_gates.py`, the l2 norm `row_norm.py` (the RMS norm's, summing instead of averaging). Written
  out, each is several element-wise and reduction passes forward and more backward, per layer: at small
  shapes each pass costs more host time than GPU time (BENCHMARKS.md, "small shapes"). The backward
  formulas (`_gates_backward`, `_l2_backward`, which the kernels compute):
      dalpha = -dg exp(A_log) sigmoid(alpha + dt_bias)  (1 where softplus is linear, above 20),
      ddt_bias = sum of dalpha,  dA_log = sum of dg g,  db = dbeta beta (1 - beta),
      l2: dx = r dy - x r^3 sum(dy x)  (r = rsqrt(sum(x^2) + eps)).

`gates` and `l2_normalize` run the kernels where they run (CUDA: `triton_gates.usable`, `row_norm.usable`)
and `naive_*` elsewhere (the CPU, Ascend NPUs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ps_bridge.kernels import row_norm
from ps_bridge.kernels.backend import wide
from ps_bridge.kernels.gdn import triton_gates
from ps_bridge.kernels.gdn.triton_gates import SOFTPLUS_THRESHOLD


def _decay_dtype(alpha: torch.Tensor, A_log: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(alpha.dtype, A_log.dtype), torch.float32)


def naive_gates(alpha, b, A_log, dt_bias):
    """(g, beta) for `alpha`, `b` `[T, HV]` and the per-head `A_log`, `dt_bias` `[HV]`."""
    acc = _decay_dtype(alpha, A_log)
    g = -A_log.to(acc).exp() * F.softplus(alpha.to(acc) + dt_bias.to(acc))
    return g, b.sigmoid()


def _gates_backward(dg, dbeta, alpha, b, A_log, dt_bias):
    acc = _decay_dtype(alpha, A_log)
    a = alpha.to(acc) + dt_bias.to(acc)
    e = A_log.to(acc).exp()
    slope = torch.where(a > SOFTPLUS_THRESHOLD, torch.ones_like(a), torch.sigmoid(a))
    dgf = dg.to(acc)
    dalpha = -dgf * e * slope
    g = -e * F.softplus(a)
    beta = b.sigmoid()  # in b's dtype, as the forward returned it
    db = wide(dbeta) * wide(beta) * (1.0 - wide(beta))
    return (dalpha.to(alpha.dtype), db.to(b.dtype), (dgf * g).sum(0).to(A_log.dtype),
            dalpha.sum(0).to(dt_bias.dtype))


def naive_l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = wide(x)
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _l2_backward(dy, x, eps: float):
    xf = wide(x)
    g = dy.to(xf.dtype)
    r = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)
    dx = r * g - xf * (r * r * r) * (g * xf).sum(-1, keepdim=True)
    return (dx.to(x.dtype),)


def gates(alpha, b, A_log, dt_bias):
    """(g, beta): the Triton kernel where it runs (`triton_gates.usable`; it reads the input projection's
    column slices in place), `naive_gates` elsewhere."""
    if triton_gates.usable(alpha, A_log):
        return triton_gates.Gates.apply(alpha, b, A_log, dt_bias)
    return naive_gates(alpha, b, A_log, dt_bias)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The Triton kernel where it runs (`row_norm.usable`), `naive_l2_normalize` elsewhere."""
    if row_norm.usable(x):
        return row_norm.RowNorm.apply(x, None, None, eps, False, False)
    return naive_l2_normalize(x, eps)
