"""The norm kernels (`ps_bridge.kernels.row_norm`) and Gated DeltaNet's gate kernels
(`ps_bridge.kernels.gdn.triton_gates`), run on the CPU by Triton's interpreter
(`TRITON_INTERPRET=1`, in a child process), against the plain expressions and autograd through them
(`rms_norm.naive`, `rms_norm.naive_gated`, `gdn.inputs.naive_l2_normalize`), in float32: the output
and every gradient (input, weight, gate) of the plain and the zero-centred RMS norm, with and without
the gate, and of the l2 norm; rows of a width that is not a power of two, rank-3 inputs, and more rows
than the backward's programs take in one step (so a program sums its weight gradient over several
steps, and the programs' sums are added), and no rows at all. In bfloat16 the kernels round as the plain
expressions do: each output is the float32 result rounded once. The gates (`inputs.naive_gates`): the decay
in float32 and beta, their gradients to the projection's column slices (read in place, a row stride wider
than the heads) and the per-head sums of `A_log`'s and `dt_bias`'s, with the decay's input on both sides of
softplus's threshold and far below zero, and no rows. On the GPU the same kernels run in Qwen3.5's layers
(tests/test_rms_norm.py, tests/test_gdn_inputs.py, marker `gpu`)."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

pytest.importorskip("triton")
sys.path.insert(0, os.path.dirname(__file__))
from triton_interpreter import run_interpreted  # noqa: E402

CHILD = textwrap.dedent(
    """
    from ps_bridge.kernels import row_norm, rms_norm as rn
    from ps_bridge.kernels.gdn import inputs

    gen = torch.Generator().manual_seed(0)
    cases = {
        "rms": (lambda x, w, z: rn.naive(x, w, 1e-6, False), True, False, False),
        "rms_zero_centred": (lambda x, w, z: rn.naive(x, w, 1e-6, True), True, False, True),
        "gated": (lambda x, w, z: rn.naive_gated(x, w, z, 1e-6, False), True, True, False),
        "gated_zero_centred": (lambda x, w, z: rn.naive_gated(x, w, z, 1e-6, True), True, True, True),
        "l2": (lambda x, w, z: inputs.naive_l2_normalize(x, 1e-6), False, False, False),
    }
    for shape in ((7, 33), (5, 3, 16), (600, 33)):
        for name, (plain, has_w, gated, zero_centered) in cases.items():
            x = (torch.randn(shape, generator=gen) * 3).requires_grad_()
            w = (torch.randn(shape[-1], generator=gen) * 0.5).requires_grad_() if has_w else None
            z = (torch.randn(shape, generator=gen) * 2).requires_grad_() if gated else None
            grad = torch.randn(shape, generator=gen)
            leaves = [t for t in (x, w, z) if t is not None]
            y = row_norm.RowNorm.apply(x, w, z, 1e-6, name != "l2", zero_centered)
            got = (y, *torch.autograd.grad(y, leaves, grad))
            y = plain(x, w, z)
            want = (y, *torch.autograd.grad(y, leaves, grad))
            for k, (a, b) in enumerate(zip(got, want)):
                key = f"{name}_{'x'.join(map(str, shape))}_{k}"
                result[key] = rel(a, b)
                result["shapes_" + key] = float(a.shape != b.shape)

    # no rows (a shard without tokens): empty outputs and gradients, a zero weight gradient
    x = torch.zeros(0, 33).requires_grad_()
    w = torch.randn(33, generator=gen).requires_grad_()
    y = row_norm.RowNorm.apply(x, w, None, 1e-6, True, True)
    dx, dw = torch.autograd.grad(y, [x, w], torch.zeros(0, 33))
    result["shapes_empty"] = float(y.shape != (0, 33) or dx.shape != (0, 33) or not torch.equal(dw, torch.zeros(33)))

    # bfloat16: the output is the float32 result rounded once
    x = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    w = torch.randn(96, generator=gen).to(torch.bfloat16)
    z = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    pairs = {
        "bf16_rms": (row_norm.RowNorm.apply(x, w, None, 1e-6, True, True), rn.naive(x, w, 1e-6, True)),
        "bf16_gated": (row_norm.RowNorm.apply(x, w, z, 1e-6, True, True), rn.naive_gated(x, w, z, 1e-6, True)),
        "bf16_l2": (row_norm.RowNorm.apply(x, None, None, 1e-6, False, False), inputs.naive_l2_normalize(x)),
    }
    for key, (a, b) in pairs.items():
        result[key] = rel(a, b)
        result["dtype_" + key] = float(a.dtype != torch.bfloat16)

    # the gates, on column slices of one projection as the model hands them over
    from ps_bridge.kernels.gdn import triton_gates
    for rows in (11, 700):
        proj = torch.randn(rows, 2 * 6 + 5, generator=gen) * 4
        proj[0, 0], proj[1, 1], proj[2, 2] = 30.0, -40.0, -25.0  # above the threshold; exp far below float32's 1 ulp
        leaves = [proj[:, :6].clone().requires_grad_(), proj[:, 6:12].clone().requires_grad_(),
                  (torch.rand(6, generator=gen) * 2).requires_grad_(), torch.randn(6, generator=gen).requires_grad_()]
        wide_proj = torch.zeros(rows, 20)  # the kernels read alpha and b in place from a wider row
        wide_proj[:, :6], wide_proj[:, 6:12] = leaves[0].detach(), leaves[1].detach()
        alpha, b = wide_proj[:, :6].requires_grad_(), wide_proj[:, 6:12].requires_grad_()
        dg, dbeta = torch.randn(rows, 6, generator=gen), torch.randn(rows, 6, generator=gen)
        g, beta = triton_gates.Gates.apply(alpha, b, leaves[2], leaves[3])
        got = (g, beta, *torch.autograd.grad((g, beta), [alpha, b, leaves[2], leaves[3]], (dg, dbeta)))
        g, beta = inputs.naive_gates(*leaves)
        want = (g, beta, *torch.autograd.grad((g, beta), leaves, (dg, dbeta)))
        for k, (a, b_) in enumerate(zip(got, want)):
            result[f"gates_{rows}_{k}"] = rel(a, b_)
            result[f"shapes_gates_{rows}_{k}"] = float(a.shape != b_.shape or a.dtype != b_.dtype)
        result[f"gates_{rows}_tiny_decay"] = float(abs(got[0][1, 1] / want[0][1, 1] - 1))

    # no rows: empty gates and input gradients, zero per-head gradients
    leaves = [torch.zeros(0, 6).requires_grad_(), torch.zeros(0, 6).requires_grad_(),
              torch.rand(6, generator=gen).requires_grad_(), torch.randn(6, generator=gen).requires_grad_()]
    g, beta = triton_gates.Gates.apply(*leaves)
    grads = torch.autograd.grad((g, beta), leaves, (torch.zeros(0, 6), torch.zeros(0, 6)))
    result["shapes_gates_empty"] = float(g.shape != (0, 6) or beta.shape != (0, 6) or grads[0].shape != (0, 6)
                                         or grads[1].shape != (0, 6) or not torch.equal(grads[2], torch.zeros(6))
                                         or not torch.equal(grads[3], torch.zeros(6)))
    """
)


def test_norm_kernels_match_the_plain_expressions():
    result = run_interpreted(CHILD)
    assert len([k for k in result if not k.startswith(("shapes_", "dtype_", "bf16_", "gates_"))]) == 3 * (3 + 3 + 4 + 4 + 2)
    assert len([k for k in result if k.startswith("gates_")]) == 2 * (6 + 1)
    for key, value in result.items():
        if key.startswith(("shapes_", "dtype_")):
            assert value == 0.0, key
        elif key.startswith("bf16_"):
            # one bf16 rounding of float32 results that differ in their last bits: at most one bf16 step (2^-8)
            assert value <= 2**-7, (key, value)
        else:
            assert value < 2e-5, (key, value)
