"""Fused Triton kernels for the softmax part of the row log-probs (`ps_bridge.rows`) over a vocabulary
(or this rank's shard of it), on CUDA.

The rows' log-probs need, per packed position, the log-sum-exp over the vocabulary, and their
gradient needs `-softmax * weight` per position (the weight: the gradient summed over the rows that
read the position). Written with torch ops chunk by chunk (`ps_bridge.rows`, the reference, and the
path on every other device) each is four or five passes over a float32 copy of a chunk of logits.
These kernels read the logits once in their own dtype:

- `row_max_sumexp(logits, keep)`: per row, `m` = the maximum over columns `[0, keep)` and
  `s = sum(exp(x - m))` (an online softmax over blocks of columns): one read;
- `minus_weighted_softmax(logits, lse, weight, keep)`: `-exp(x - lse) * weight` per row, 0 from column
  `keep` on (a padded vocabulary's extra ids), in the logits' dtype: one read, one write.

Columns from `keep` on are left out of both (`keep` = 0: `m` = -inf, `s` = 0). `usable(t)` says where
they run: a CUDA tensor whose last dimension is contiguous, with Triton importable.
"""

from __future__ import annotations


import torch

from ps_bridge.kernels.backend import triton_kernels

BLOCK = 4096  # columns per step (a 152k vocabulary: 38 steps per row)


@triton_kernels
def _triton(triton, tl):

    @triton.jit
    def row_max_sumexp_kernel(logits, stride, m_out, s_out, keep, BV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        for start in range(0, keep, BV):
            cols = start + tl.arange(0, BV)
            x = tl.load(base + cols, mask=cols < keep, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(x, 0))  # finite: every block holds a column below keep
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
            m = new_m
        tl.store(m_out + row, m)
        tl.store(s_out + row, s)

    @triton.jit
    def minus_weighted_softmax_kernel(logits, stride, lse, weight, grad, grad_stride, keep, V, BV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BV + tl.arange(0, BV)
        inside = cols < V
        x = tl.load(logits + row * stride + cols, mask=inside, other=0.0).to(tl.float32)
        g = -tl.exp(x - tl.load(lse + row)) * tl.load(weight + row)
        g = tl.where(cols < keep, g, 0.0)
        tl.store(grad + row * grad_stride + cols, g.to(grad.dtype.element_ty), mask=inside)

    return triton, row_max_sumexp_kernel, minus_weighted_softmax_kernel


def usable(logits: torch.Tensor) -> bool:
    """Whether the kernels run on `logits` `[T, V]`: a CUDA tensor, last dimension contiguous, Triton
    importable. (Under Triton's interpreter they also run on CPU tensors: tests/test_vocab_softmax_interpreter.py.)"""
    return logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1 and _triton() is not None


def row_max_sumexp(logits: torch.Tensor, keep: int):
    """Per row of `logits` `[T, V]`: (max over columns `[0, keep)`, sum of exp(x - max)), float32."""
    triton, kernel, _ = _triton()
    T = logits.shape[0]
    m = torch.empty(T, dtype=torch.float32, device=logits.device)
    s = torch.empty(T, dtype=torch.float32, device=logits.device)
    if T:
        kernel[(T,)](logits, logits.stride(0), m, s, int(keep), BV=BLOCK, num_warps=8)
    return m, s


def minus_weighted_softmax(logits: torch.Tensor, lse: torch.Tensor, weight: torch.Tensor, keep: int) -> torch.Tensor:
    """`-exp(logits - lse[:, None]) * weight[:, None]`, 0 from column `keep` on, in the logits' dtype."""
    triton, _, kernel = _triton()
    T, V = logits.shape
    grad = torch.empty_like(logits)
    if T and V:
        kernel[(T, triton.cdiv(V, BLOCK))](logits, logits.stride(0), lse.contiguous(), weight.contiguous(), grad,
                                           grad.stride(0), int(keep), V, BV=BLOCK, num_warps=8)
    return grad
