"""ps_bridge.kernels.rms_norm: the fused path's backward formula (the function torch.compile compiles
on CUDA) equals autograd through the plain expression, in float64 on the CPU, for the plain and the
zero-centred scale; bf16 inputs round once, as the plain expression does. On the GPU (marker `gpu`):
the compiled kernels against the plain expression."""

import pytest
import torch

from ps_bridge.kernels import rms_norm as rn


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(7, 33), (5, 3, 16)])
def test_backward_formula_equals_autograd(shape, zero_centered):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).requires_grad_()
    w = (torch.randn(shape[-1], generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    grad = torch.randn(shape, generator=g, dtype=torch.float64)
    rn.naive(x, w, 1e-6, zero_centered).backward(grad)
    dx, dw = rn._backward(grad, x.detach(), w.detach(), 1e-6, zero_centered)
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, w.grad, rtol=1e-12, atol=1e-12)


def test_zero_centred_scale_is_one_plus_weight():
    x = torch.randn(4, 8, dtype=torch.float64)
    w = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(rn.naive(x, w, 1e-6, True), rn.naive(x, 1.0 + w, 1e-6, False))
    # the plain formula: x / rms(x) * w
    rms = x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(rn.naive(x, w, 1e-6, False), x / rms * w)


def test_bf16_rounds_once():
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    exact = rn.naive(x.double(), w.double(), 1e-6, True).to(torch.bfloat16)
    assert torch.equal(rn.rms_norm(x, w, 1e-6, zero_centered=True), exact)
    dx, dw = rn._backward(torch.ones_like(x), x, w, 1e-6, True)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("zero_centered", [False, True])
def test_gpu_fused_equals_naive(zero_centered):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for tokens in (1000, 24576):  # a second row count: the compiled kernels are dynamic, not recompiled
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(2048, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
        grad = torch.randn_like(x)
        y = rn.fused(x, w, 1e-6, zero_centered)
        dx, dw = torch.autograd.grad(y, (x, w), grad)
        ref = rn.naive(x.double(), w.double(), 1e-6, zero_centered)
        rdx, rdw = torch.autograd.grad(ref, (x, w), grad.double())
        plain = rn.naive(x, w, 1e-6, zero_centered)
        pdx, pdw = torch.autograd.grad(plain, (x, w), grad)
        for got, want, eager in ((y, ref, plain), (dx, rdx, pdx), (dw, rdw, pdw)):
            err = (got.double() - want.double()).norm() / want.double().norm()
            err_eager = (eager.double() - want.double()).norm() / want.double().norm()
            assert err <= 1.1 * err_eager + 1e-6, (err, err_eager)
