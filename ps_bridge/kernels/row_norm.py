"""Triton kernels for the norms over the last dimension of Qwen3.5's layers, on CUDA: RMSNorm
(`rms_norm.py`: plain or zero-centred scale, optionally times Gated DeltaNet's `silu` gate) and the
l2 norm of q and k (`gdn/inputs.py`).

One kernel forward and one backward for all of them, the norm's kind chosen by constants:
    y = x r s            r = rsqrt(mean(x^2) + eps)  (RMS)   or   rsqrt(sum(x^2) + eps)  (l2)
    s = w, or 1 + w (zero-centred), or 1 (l2);  gated: y = round(x r s) silu(z)
computed in float32 and rounded once to the input's dtype (the gated norm rounds the norm first, as
the norm module followed by the gate's product does). The backward recomputes `r` from `x`:
    gated:  dz = g y sigma(z) (1 + z (1 - sigma(z))),  g <- g z sigma(z)
    dx = r g s - x r^3 mean(g s x)  (RMS; sum for l2),   dw = sum over rows of g x r
with `dw` summed per program over a share of the rows and the shares added by torch (one partial
row of float32 per program).

These are the formulas of `rms_norm.naive`/`_backward`, `rms_norm.naive_gated`/`_gated_backward`
and `gdn.inputs.naive_l2_normalize`/`_l2_backward`. The same arithmetic compiled by torch.compile
costs 0.3 ms of host time per call forward and 0.4 ms backward (Dynamo's guards, the compiled graph's
wrapper; under the profiler, docs/bench/profile-qwen3.5-9b-one-level-h100-2026-12-06.md), which at
Qwen3.5's shared shapes is longer than the GPU work of the layer's Gated DeltaNet part; these kernels
cost 0.1 ms forward and 0.15 ms backward in the same profile.

`usable(x)` says where they run: a CUDA tensor of a half, bfloat16 or float32 dtype whose last
dimension is at most `MAX_COLUMNS`, Triton importable. (Under Triton's interpreter they also run on
CPU tensors: tests/test_row_norm_interpreter.py.)
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ps_bridge.kernels.backend import triton_kernels

MAX_COLUMNS = 16384  # one program holds a row's columns in registers
ELEMENTS = 2048  # a program's rows x columns per step (several short rows, as GDN's per-head ones, per step)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton_kernels
def _triton(triton, tl):

    @triton.jit
    def row_norm_fwd(x, w, z, y, M, N, eps, MEAN: tl.constexpr, HAS_W: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                     GATED: tl.constexpr, R: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * R + tl.arange(0, R)
        cols = tl.arange(0, BN)
        inside = cols < N
        mask = (rows < M)[:, None] & inside[None, :]
        at = rows[:, None].to(tl.int64) * N + cols[None, :]
        xf = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
        ss = tl.sum(xf * xf, 1)
        if MEAN:
            ss = ss / N
        out = xf * (1.0 / tl.sqrt(ss + eps))[:, None]
        if HAS_W:
            s = tl.load(w + cols, mask=inside, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                s = 1.0 + s
            out = out * s[None, :]
        if GATED:
            zf = tl.load(z + at, mask=mask, other=0.0).to(tl.float32)
            out = out.to(y.dtype.element_ty).to(tl.float32) * (zf * tl.sigmoid(zf))
        tl.store(y + at, out.to(y.dtype.element_ty), mask=mask)

    @triton.jit
    def row_norm_bwd(dy, x, w, z, dx, dz, dw_part, M, N, eps, rows_per_program, MEAN: tl.constexpr,
                     HAS_W: tl.constexpr, ZERO_CENTERED: tl.constexpr, GATED: tl.constexpr, R: tl.constexpr,
                     BN: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BN)
        inside = cols < N
        s = tl.full([BN], 1.0, tl.float32)
        if HAS_W:
            s = tl.load(w + cols, mask=inside, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                s = 1.0 + s
        dw = tl.zeros([BN], tl.float32)
        first = pid * rows_per_program
        for start in range(first, first + rows_per_program, R):
            rows = start + tl.arange(0, R)
            mask = (rows < M)[:, None] & inside[None, :]
            at = rows[:, None].to(tl.int64) * N + cols[None, :]
            xf = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(dy + at, mask=mask, other=0.0).to(tl.float32)
            ss = tl.sum(xf * xf, 1)
            if MEAN:
                ss = ss / N
            r = (1.0 / tl.sqrt(ss + eps))[:, None]
            if GATED:
                zf = tl.load(z + at, mask=mask, other=0.0).to(tl.float32)
                sig = tl.sigmoid(zf)
                norm = (xf * r * s[None, :]).to(dx.dtype.element_ty).to(tl.float32)  # as the forward rounded it
                tl.store(dz + at, (g * norm * sig * (1.0 + zf * (1.0 - sig))).to(dz.dtype.element_ty), mask=mask)
                g = g * (zf * sig)
            if HAS_W:
                dw += tl.sum(g * xf * r, 0)
            gs = g * s[None, :]
            c = tl.sum(gs * xf, 1)
            if MEAN:
                c = c / N
            out = r * gs - xf * (r * r * r) * c[:, None]
            tl.store(dx + at, out.to(dx.dtype.element_ty), mask=mask)
        if HAS_W:
            tl.store(dw_part + pid.to(tl.int64) * N + cols, dw, mask=inside)

    return triton, row_norm_fwd, row_norm_bwd


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels run on `x`: CUDA, a half, bfloat16 or float32 dtype, a last dimension of at
    most `MAX_COLUMNS`, Triton importable."""
    return x.is_cuda and x.dtype in DTYPES and 0 < x.shape[-1] <= MAX_COLUMNS and _triton() is not None


def blocks(n: int):
    """(rows per step R, columns BN, warps) for rows of `n` columns (the gate kernels' too)."""
    bn = 1 << max(n - 1, 0).bit_length()
    rows = max(1, ELEMENTS // bn)
    return rows, bn, 8 if rows * bn >= 4096 else 4


@functools.lru_cache(maxsize=None)
def _max_programs(device: torch.device) -> int:
    """Four programs per multiprocessor (8 where there is no CUDA device: the interpreter)."""
    if device.type != "cuda":
        return 8
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def programs_for(M: int, R: int, device: torch.device):
    """(programs, rows per program) of a backward that sums per-column values over `M` rows, `R` rows a
    step: each program takes a whole number of steps, and every program has a row (one program of one
    step where there are no rows)."""
    def ceil(a, b):
        return -(-a // b)

    programs = max(1, min(ceil(M, R), _max_programs(device)))
    rows_per_program = max(1, ceil(ceil(M, programs), R)) * R
    return max(1, ceil(M, rows_per_program)), rows_per_program


def forward(x: torch.Tensor, weight: Optional[torch.Tensor], gate: Optional[torch.Tensor], eps: float, mean: bool,
            zero_centered: bool) -> torch.Tensor:
    """The norm of the rows of `x` `[M, N]` (contiguous; `gate` likewise), in `x`'s dtype."""
    triton, kernel, _ = _triton()
    M, N = x.shape
    y = torch.empty_like(x)
    if M:
        R, BN, warps = blocks(N)
        kernel[(triton.cdiv(M, R),)](
            x, x if weight is None else weight, x if gate is None else gate, y, M, N, eps, MEAN=mean,
            HAS_W=weight is not None, ZERO_CENTERED=zero_centered, GATED=gate is not None, R=R, BN=BN, num_warps=warps)
    return y


def backward(grad: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], gate: Optional[torch.Tensor],
             eps: float, mean: bool, zero_centered: bool):
    """(dx, dw, dz) of `forward` for its output gradient `grad` (contiguous, as `x`); dw None without a
    weight, dz None without a gate; each in its tensor's dtype."""
    _, _, kernel = _triton()
    M, N = x.shape
    R, BN, warps = blocks(N)
    programs, rows_per_program = programs_for(M, R, x.device)
    dx = torch.empty_like(x)
    dz = None if gate is None else torch.empty_like(gate)
    part = None if weight is None else torch.empty(programs, N, dtype=torch.float32, device=x.device)
    if M:
        kernel[(programs,)](
            grad, x, x if weight is None else weight, x if gate is None else gate, dx, dx if dz is None else dz,
            dx if part is None else part, M, N, eps, rows_per_program, MEAN=mean, HAS_W=weight is not None,
            ZERO_CENTERED=zero_centered, GATED=gate is not None, R=R, BN=BN, num_warps=warps)
    dw = None
    if weight is not None:
        dw = (part.sum(0) if M else torch.zeros(N, dtype=torch.float32, device=x.device)).to(weight.dtype)
    return dx, dw, dz


class RowNorm(torch.autograd.Function):
    """`forward`/`backward` under autograd, on tensors of any rank (their last dimension the norm's):
    `RowNorm.apply(x, weight, gate, eps, mean, zero_centered)`; weight and gate may be None."""

    @staticmethod
    def forward(ctx, x, weight, gate, eps, mean, zero_centered):
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()
        z = None if gate is None else gate.reshape(-1, shape[-1]).contiguous()
        ctx.save_for_backward(rows, weight, z)
        ctx.constants, ctx.shape = (eps, mean, zero_centered), shape
        return forward(rows, weight, z, eps, mean, zero_centered).view(shape)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, z = ctx.saved_tensors
        dx, dw, dz = backward(grad.reshape(rows.shape).contiguous(), rows, weight, z, *ctx.constants)
        return dx.view(ctx.shape), dw, None if dz is None else dz.view(ctx.shape), None, None, None
