"""ps_bridge.kernels.gdn.inputs and backend.CompiledOp: the backward formulas (what the Triton kernels
compute on CUDA) equal autograd through the plain expressions in float64 on the CPU (the
decay gate on both sides of softplus's threshold); the plain expressions round as the model computed
them before (beta in its own dtype, the decay in float32); CompiledOp hands autograd the backward's
gradients for its tensors and none for its constants. On the GPU (marker `gpu`): the gates' and the l2
norm's Triton kernels (`triton_gates.py`, `row_norm.py`) against the plain expressions, by relative error
to a float64 reference."""

import pytest
import torch
import torch.nn.functional as F

from ps_bridge.kernels import backend
from ps_bridge.kernels.gdn import inputs
from test_rms_norm import assert_op_no_worse, assert_fused_no_worse


def _gate_inputs(dtype, device="cpu", rows=11, heads=6, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    alpha = torch.randn(rows, heads, generator=g, device=device, dtype=torch.float64) * 4
    alpha[0, 0] = 30.0  # above softplus's threshold: the identity there
    b = torch.randn(rows, heads, generator=g, device=device, dtype=torch.float64) * 2
    A_log = torch.randn(heads, generator=g, device=device, dtype=torch.float64) * 0.5
    dt_bias = torch.randn(heads, generator=g, device=device, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (alpha, b, A_log, dt_bias)]


def test_gates_backward_formula_equals_autograd():
    args = _gate_inputs(torch.float64)
    g, beta = inputs.naive_gates(*args)
    dg, dbeta = torch.randn_like(g), torch.randn_like(beta)
    torch.autograd.backward((g, beta), (dg, dbeta))
    got = inputs._gates_backward(dg, dbeta, *(t.detach() for t in args))
    for a, t in zip(got, args):
        torch.testing.assert_close(a, t.grad, rtol=1e-12, atol=1e-12)


def test_gates_round_as_the_model_did():
    alpha, b, A_log, dt_bias = (t.detach() for t in _gate_inputs(torch.bfloat16))
    A_log, dt_bias = A_log.float(), dt_bias.float()
    g, beta = inputs.gates(alpha, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
    assert torch.equal(g, -A_log.exp() * F.softplus(alpha.float() + dt_bias))
    assert torch.equal(beta, b.sigmoid())


@pytest.mark.parametrize("shape", [(7, 3, 16), (5, 33)])
def test_l2_backward_formula_equals_autograd(shape):
    x = (torch.randn(shape, dtype=torch.float64) * 3).requires_grad_()
    dy = torch.randn(shape, dtype=torch.float64)
    inputs.naive_l2_normalize(x).backward(dy)
    (dx,) = inputs._l2_backward(dy, x.detach(), 1e-6)
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(inputs.l2_normalize(x.detach()).norm(dim=-1), torch.ones(shape[:-1], dtype=torch.float64))


def test_compiled_op_runs_under_autograd():
    """The autograd wiring, with the plain functions in place of the compiled ones: the forward's
    value, the backward's gradients for the tensors, none for the constants, several outputs."""
    op = backend.CompiledOp(inputs.naive_gates, inputs._gates_backward, num_tensors=4, contiguous=False)
    op.__dict__["compiled"] = (inputs.naive_gates, inputs._gates_backward)  # the cached_property's slot
    args = _gate_inputs(torch.float64)
    g, beta = op(*args)
    want = inputs.naive_gates(*args)
    assert torch.equal(g, want[0]) and torch.equal(beta, want[1])
    (g.sum() + beta.square().sum()).backward()
    expect = torch.autograd.grad(want[0].sum() + want[1].square().sum(), args)
    for t, e in zip(args, expect):
        torch.testing.assert_close(t.grad, e, rtol=1e-12, atol=1e-12)
    l2 = backend.CompiledOp(inputs.naive_l2_normalize, inputs._l2_backward, num_tensors=1)
    l2.__dict__["compiled"] = (inputs.naive_l2_normalize, inputs._l2_backward)
    x = torch.randn(4, 8, dtype=torch.float64).t().requires_grad_()  # not contiguous: copied first
    l2(x, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(inputs.naive_l2_normalize(x).sum(), x)[0])
    x = torch.randn(5, 1, 3, 8, dtype=torch.float64).requires_grad_()  # rank 4: passed as rows, shaped back
    y = l2(x, 1e-6)
    assert y.shape == x.shape
    torch.testing.assert_close(y, inputs.naive_l2_normalize(x))
    dy = torch.randn_like(x)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(inputs.naive_l2_normalize(x), x, dy)[0])


@pytest.mark.gpu
def test_gpu_fused_gates_and_l2_equal_naive():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for rows in (300, 24576):
        gen = torch.Generator(device="cuda").manual_seed(rows)
        proj = (torch.randn(rows, 64, generator=gen, device="cuda") * 3).to(torch.bfloat16)
        alpha, b = proj[:, :32], proj[:, 32:]  # column slices of one projection, as in the model
        A_log = (torch.rand(32, generator=gen, device="cuda") * 2).requires_grad_()
        dt_bias = torch.randn(32, generator=gen, device="cuda").requires_grad_()
        alpha, b = alpha.detach().requires_grad_(), b.detach().requires_grad_()
        dg = torch.randn(rows, 32, generator=gen, device="cuda")
        dbeta = torch.randn(rows, 32, generator=gen, device="cuda").to(torch.bfloat16)

        def run(fn, *args):
            g, beta = fn(*args)
            return (g, beta, *torch.autograd.grad((g, beta), args, (dg.to(g.dtype), dbeta.to(beta.dtype))))

        ref = run(inputs.naive_gates, *(t.double() for t in (alpha, b, A_log, dt_bias)))
        got, plain = run(inputs.gates, alpha, b, A_log, dt_bias), run(inputs.naive_gates, alpha, b, A_log, dt_bias)
        assert_fused_no_worse(f"gates rows={rows}", got, ref, plain)
        x = (torch.randn(rows, 16, 128, generator=gen, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(rows, 16, 128, generator=gen, device="cuda").to(torch.bfloat16)
        # through `l2_normalize`: the rank-3 q/k go to the kernel as rows
        assert_op_no_worse(f"l2 rows={rows}", inputs.l2_normalize, inputs.naive_l2_normalize, (x,), dy)
