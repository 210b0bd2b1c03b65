"""Gated DeltaNet's decay and beta gates (`inputs.naive_gates`) as one Triton kernel each way, on CUDA.

Per token and value head, from the input projection's column slices `alpha`, `b` `[T, HV]` and the
per-head `A_log`, `dt_bias` `[HV]`:
    g = -exp(A_log) softplus(alpha + dt_bias)   in float32 (softplus the identity above 20, as torch's)
    beta = sigmoid(b)                            in b's dtype
and backward (`inputs._gates_backward`'s formulas):
    dalpha = -dg exp(A_log) sigmoid(alpha + dt_bias)  (1 above 20),   db = dbeta beta (1 - beta),
    dA_log = sum over tokens of dg g,   ddt_bias = sum over tokens of dalpha
with the two sums taken per program over a share of the tokens and the shares added by torch. The
kernels read `alpha` and `b` in place (any row stride), as the projection's output holds them.

The same arithmetic compiled by torch.compile cost 0.6 ms of host time per layer forward and 0.9 ms
backward under the profiler (Dynamo's guards, the compiled graph's wrapper), these kernels 0.16 and 0.42 ms
in the same profile (docs/bench/profile-qwen3.5-0.8b-triton-gates-before-after-h100-2026-12-06.md).

`usable(alpha, A_log)` says where they run: CUDA tensors of half, bfloat16 or float32 dtypes, Triton
importable. (Under Triton's interpreter they also run on CPU tensors: tests/test_row_norm_interpreter.py.)
"""

from __future__ import annotations

import torch

from ps_bridge.kernels.backend import triton_kernels
from ps_bridge.kernels.row_norm import DTYPES, blocks, programs_for

SOFTPLUS_THRESHOLD = 20.0  # torch's softplus is the identity above this (its default threshold)
SMALL = 1e-4  # below this log(1 + y) is y (1 - y / 2): float32's log(1 + y) would lose y


@triton_kernels
def _triton(triton, tl):

    @triton.jit
    def gates_fwd(alpha, b, A_log, dt_bias, g, beta, M, H, stride_alpha, stride_b, THRESHOLD: tl.constexpr,
                  SMALL_Y: tl.constexpr, R: tl.constexpr, BH: tl.constexpr):
        rows = tl.program_id(0) * R + tl.arange(0, R)
        cols = tl.arange(0, BH)
        inside = cols < H
        mask = (rows < M)[:, None] & inside[None, :]
        rows = rows.to(tl.int64)[:, None]
        a = tl.load(alpha + rows * stride_alpha + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = a + tl.load(dt_bias + cols, mask=inside, other=0.0).to(tl.float32)[None, :]
        e = tl.exp(tl.load(A_log + cols, mask=inside, other=0.0).to(tl.float32))[None, :]
        y = tl.exp(tl.minimum(a, THRESHOLD))  # softplus(a), as in the backward
        softplus = tl.where(a > THRESHOLD, a, tl.where(y < SMALL_Y, y * (1.0 - 0.5 * y), tl.log(1.0 + y)))
        tl.store(g + rows * H + cols[None, :], -e * softplus, mask=mask)
        bf = tl.load(b + rows * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(beta + rows * H + cols[None, :], tl.sigmoid(bf).to(beta.dtype.element_ty), mask=mask)

    @triton.jit
    def gates_bwd(dg, dbeta, alpha, b, A_log, dt_bias, dalpha, db, dA_part, ddt_part, M, H, stride_alpha, stride_b,
                  rows_per_program, THRESHOLD: tl.constexpr, SMALL_Y: tl.constexpr, R: tl.constexpr,
                  BH: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BH)
        inside = cols < H
        bias = tl.load(dt_bias + cols, mask=inside, other=0.0).to(tl.float32)[None, :]
        e = tl.exp(tl.load(A_log + cols, mask=inside, other=0.0).to(tl.float32))[None, :]
        dA = tl.zeros([BH], tl.float32)
        ddt = tl.zeros([BH], tl.float32)
        first = pid * rows_per_program
        for start in range(first, first + rows_per_program, R):
            rows = start + tl.arange(0, R)
            mask = (rows < M)[:, None] & inside[None, :]
            rows = rows.to(tl.int64)[:, None]
            a = tl.load(alpha + rows * stride_alpha + cols[None, :], mask=mask, other=0.0).to(tl.float32) + bias
            dgf = tl.load(dg + rows * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            slope = tl.where(a > THRESHOLD, 1.0, tl.sigmoid(a))
            da = -dgf * e * slope
            tl.store(dalpha + rows * H + cols[None, :], da.to(dalpha.dtype.element_ty), mask=mask)
            y = tl.exp(tl.minimum(a, THRESHOLD))  # softplus(a), as in the forward
            softplus = tl.where(a > THRESHOLD, a, tl.where(y < SMALL_Y, y * (1.0 - 0.5 * y), tl.log(1.0 + y)))
            dA += tl.sum(dgf * (-e * softplus), 0)
            ddt += tl.sum(da, 0)
            bf = tl.load(b + rows * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            beta = tl.sigmoid(bf).to(db.dtype.element_ty).to(tl.float32)  # as the forward returned it
            dbf = tl.load(dbeta + rows * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(db + rows * H + cols[None, :], (dbf * beta * (1.0 - beta)).to(db.dtype.element_ty), mask=mask)
        tl.store(dA_part + pid.to(tl.int64) * H + cols, dA, mask=inside)
        tl.store(ddt_part + pid.to(tl.int64) * H + cols, ddt, mask=inside)

    return triton, gates_fwd, gates_bwd


def usable(alpha: torch.Tensor, A_log: torch.Tensor) -> bool:
    """Whether the kernels run: CUDA, half/bfloat16/float32 inputs, Triton importable."""
    return (alpha.is_cuda and alpha.dtype in DTYPES and A_log.dtype in DTYPES and alpha.dim() == 2
            and alpha.stride(-1) == 1 and _triton() is not None)


def forward(alpha: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g float32, beta in b's dtype) of `alpha`, `b` `[T, HV]` (last dimension contiguous)."""
    triton, kernel, _ = _triton()
    M, H = alpha.shape
    g = torch.empty(M, H, dtype=torch.float32, device=alpha.device)
    beta = torch.empty(M, H, dtype=b.dtype, device=b.device)
    R, BH, warps = blocks(H)
    if M:
        kernel[(triton.cdiv(M, R),)](alpha, b, A_log, dt_bias, g, beta, M, H, alpha.stride(0), b.stride(0),
                                     THRESHOLD=SOFTPLUS_THRESHOLD, SMALL_Y=SMALL, R=R, BH=BH, num_warps=warps)
    return g, beta


def backward(dg: torch.Tensor, dbeta: torch.Tensor, alpha, b, A_log, dt_bias):
    """(dalpha, db, dA_log, ddt_bias), each in its tensor's dtype, for the output gradients `dg`, `dbeta`
    `[T, HV]` (contiguous)."""
    triton, _, kernel = _triton()
    M, H = alpha.shape
    R, BH, warps = blocks(H)
    programs, rows_per_program = programs_for(M, R, alpha.device)
    dalpha = torch.empty(M, H, dtype=alpha.dtype, device=alpha.device)
    db = torch.empty(M, H, dtype=b.dtype, device=b.device)
    parts = torch.zeros(2, programs, H, dtype=torch.float32, device=alpha.device)
    if M:
        kernel[(programs,)](dg, dbeta, alpha, b, A_log, dt_bias, dalpha, db, parts[0], parts[1], M, H,
                            alpha.stride(0), b.stride(0), rows_per_program, THRESHOLD=SOFTPLUS_THRESHOLD,
                            SMALL_Y=SMALL, R=R, BH=BH, num_warps=warps)
    sums = parts.sum(1)
    return dalpha, db, sums[0].to(A_log.dtype), sums[1].to(dt_bias.dtype)


class Gates(torch.autograd.Function):
    """`forward`/`backward` under autograd: `(g, beta) = Gates.apply(alpha, b, A_log, dt_bias)`."""

    @staticmethod
    def forward(ctx, alpha, b, A_log, dt_bias):
        if b.stride(-1) != 1:
            b = b.contiguous()
        ctx.save_for_backward(alpha, b, A_log, dt_bias)
        return forward(alpha, b, A_log, dt_bias)

    @staticmethod
    def backward(ctx, dg, dbeta):
        alpha, b, A_log, dt_bias = ctx.saved_tensors
        dg = torch.zeros(alpha.shape, dtype=torch.float32, device=alpha.device) if dg is None else dg.contiguous()
        dbeta = torch.zeros_like(b) if dbeta is None else dbeta.contiguous()
        return backward(dg, dbeta, alpha, b, A_log, dt_bias)
