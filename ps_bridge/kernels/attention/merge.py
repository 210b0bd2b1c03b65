"""Merging attention partials: the outputs and log-sum-exps of the same queries over disjoint key sets
combine into the attention over the union of the keys.

For partials `(o_i, l_i)`: `lse = log(sum_i exp(l_i))`, `out = sum_i exp(l_i - lse) o_i`. The cascade
(`cascade.py`) merges, per tree level, the level's own causal partial with one partial per ancestor
level.

- `merge_all`: the plain reference, in torch ops (any device), float32 arithmetic for half-precision
  partials, rounded once. On a CUDA bf16 pack of 16k query rows x 32 heads x 128 it is seven passes
  (two float32 copies of the partials, a product and a sum each, the rounding, the copy into place).
- `merge_into`: what the cascade calls. It updates the first partial (a view of the packed output and
  of its log-sum-exp) in place with the others. On CUDA with Triton, one kernel reads every partial
  once and writes the result once, with the same float32 arithmetic; elsewhere it is `merge_all`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ps_bridge.kernels.backend import triton_kernels

TOKENS = 32  # query rows per Triton program (x one head x the head dim)
FUSED_PARTIALS = (2, 3)  # the kernel's partial counts: a depth-one level merges 2, a depth-two level 3


def merge_all(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]):
    """Merge attention partials over disjoint key sets of the same queries, in float32.

    outs [T, H, D], lses [H, T] fp32 -> (out [T, H, D] in the first out's dtype, lse [H, T] fp32)."""
    # two partials (every level of a depth-one layout): logaddexp, no stacked copy
    lse = torch.logaddexp(lses[0], lses[1]) if len(lses) == 2 else torch.logsumexp(torch.stack(list(lses)), dim=0)
    acc = torch.promote_types(outs[0].dtype, torch.float32)  # bf16 partials are merged in float32
    total = None
    for o, l in zip(outs, lses):
        term = torch.exp(l - lse).transpose(0, 1).unsqueeze(-1) * o.to(acc)
        total = term if total is None else total + term
    return total.to(outs[0].dtype), lse


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Two partials (`merge_all` of two)."""
    return merge_all([out_a, out_b], [lse_a, lse_b])


@triton_kernels
def _triton(triton, tl):

    @triton.jit
    def merge_kernel(out, out_t, out_h, lse, lse_h, o1, o1_t, o1_h, l1, l1_h, o2, o2_t, o2_h, l2, l2_h, T, D,
                     THREE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        h = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        d = tl.arange(0, BD)
        rows = t < T
        tile = rows[:, None] & (d < D)[None, :]
        la = tl.load(lse + h * lse_h + t, mask=rows, other=float("-inf"))
        lb = tl.load(l1 + h * l1_h + t, mask=rows, other=float("-inf"))
        m = tl.maximum(la, lb)
        if THREE:
            lc = tl.load(l2 + h * l2_h + t, mask=rows, other=float("-inf"))
            m = tl.maximum(m, lc)
        m = tl.where(m == float("-inf"), 0.0, m)  # a row without keys anywhere: weights 0, lse -inf
        ea = tl.exp(la - m)
        eb = tl.exp(lb - m)
        s = ea + eb
        if THREE:
            ec = tl.exp(lc - m)
            s += ec
        inv = tl.where(s > 0, 1.0 / s, 0.0)
        acc = (ea * inv)[:, None] * tl.load(out + t[:, None] * out_t + h * out_h + d[None, :], mask=tile).to(tl.float32)
        acc += (eb * inv)[:, None] * tl.load(o1 + t[:, None] * o1_t + h * o1_h + d[None, :], mask=tile).to(tl.float32)
        if THREE:
            acc += (ec * inv)[:, None] * tl.load(o2 + t[:, None] * o2_t + h * o2_h + d[None, :], mask=tile).to(tl.float32)
        tl.store(out + t[:, None] * out_t + h * out_h + d[None, :], acc.to(out.dtype.element_ty), mask=tile)
        tl.store(lse + h * lse_h + t, m + tl.log(s), mask=rows)

    return triton, merge_kernel


def fused(out: torch.Tensor, outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> bool:
    """Whether `merge_into` runs the kernel: CUDA tensors with a contiguous head dim and float32
    log-sum-exps contiguous along the tokens, a partial count the kernel has, Triton importable.
    (Under Triton's interpreter it also runs on CPU tensors: tests/test_attention_merge_interpreter.py.)"""
    parts = [out, *outs]
    return (
        out.is_cuda
        and 1 + len(outs) in FUSED_PARTIALS
        and all(o.stride(-1) == 1 and o.dtype == out.dtype for o in parts)
        and all(l.dtype == torch.float32 and l.stride(-1) == 1 for l in lses)
        and _triton() is not None
    )


def merge_into(out: torch.Tensor, lse: torch.Tensor, outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor],
               kernel: Optional[bool] = None) -> None:
    """Merge the partials `outs`/`lses` into `out [T, H, D]`/`lse [H, T]` (the first partial), in place.

    `kernel`: run the Triton kernel (True), the torch reference (False), or choose (None: `fused`)."""
    if kernel is None:
        kernel = fused(out, outs, [lse, *lses])
    if not kernel:
        merged, merged_lse = merge_all([out, *outs], [lse, *lses])
        out.copy_(merged)
        lse.copy_(merged_lse)
        return
    triton, merge_kernel = _triton()
    T, H, D = out.shape
    if T == 0:
        return
    o2, l2 = (outs[1], lses[1]) if len(outs) == 2 else (outs[0], lses[0])  # unread when two partials
    o1, l1 = outs[0], lses[0]
    grid = (triton.cdiv(T, TOKENS), H)
    merge_kernel[grid](
        out, out.stride(0), out.stride(1), lse, lse.stride(0),
        o1, o1.stride(0), o1.stride(1), l1, l1.stride(0),
        o2, o2.stride(0), o2.stride(1), l2, l2.stride(0),
        T, D, THREE=len(outs) == 2, BT=TOKENS, BD=triton.next_power_of_2(D), num_warps=4,
    )
