"""ps_bridge.kernels.rms_norm: the one-pass backward formulas (what the Triton kernel computes on CUDA,
`row_norm.py`) equal autograd through the plain expressions, in float64 on the CPU, for the plain and the
zero-centred scale, with and without Gated DeltaNet's `silu` gate; bf16 inputs round as the plain
expressions do. On the GPU (marker `gpu`): `rms_norm` and `gated_rms_norm` (the Triton kernel there)
against the plain expressions, by relative error to a float64 reference; the kernel itself runs on the
CPU under Triton's interpreter in tests/test_row_norm_interpreter.py."""

import pytest
import torch

from ps_bridge.kernels import rms_norm as rn

# The gradients of bf16 inputs are bf16, and so is the float64 reference's (its input is the bf16 tensor):
# compiled and plain kernels then differ from it only where a float32 result sits near a bf16 rounding
# boundary, relative errors of 1e-5 whose ratio is noise. A wrong formula is off by far more than this.
TOLERANCE_FLOOR = 1e-4


def assert_fused_no_worse(label: str, fused, reference, plain) -> None:
    """Each of `fused`'s tensors (a compiled op's output and gradients) is no further, by relative error, from
    the float64 `reference` than the plain expression's `plain` (up to TOLERANCE_FLOOR)."""
    for k, (got, want, eager) in enumerate(zip(fused, reference, plain)):
        want = want.double()
        err = ((got.double() - want).norm() / want.norm()).item()
        err_plain = ((eager.double() - want).norm() / want.norm()).item()
        print(f"{label} tensor {k}: {err:.3e} (plain {err_plain:.3e})")
        assert err <= 1.1 * err_plain + TOLERANCE_FLOOR, (label, k, err, err_plain)


def assert_op_no_worse(label: str, fused, plain, tensors, grad, *constants) -> None:
    """`assert_fused_no_worse` for a one-output op: `fused(*tensors, *constants)` (a Triton kernel's or a
    compiled op's path) and `plain(...)` on the bf16 leaves `tensors`, the reference `plain` on their float64
    copies; each output and its gradients to the leaves for the output gradient `grad`."""

    def run(fn, args):
        y = fn(*args, *constants)
        return (y, *torch.autograd.grad(y, tensors, grad.to(y.dtype)))

    assert_fused_no_worse(label, run(fused, tensors), run(plain, [t.double() for t in tensors]), run(plain, tensors))


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


@pytest.mark.parametrize("zero_centered", [False, True])
def test_gated_backward_formula_equals_autograd(zero_centered):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 32, generator=g, dtype=torch.float64) * 2).requires_grad_()
    w = (torch.randn(32, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    z = (torch.randn(9, 32, generator=g, dtype=torch.float64) * 3).requires_grad_()
    grad = torch.randn(9, 32, generator=g, dtype=torch.float64)
    rn.naive_gated(x, w, z, 1e-6, zero_centered).backward(grad)
    dx, dw, dz = rn._gated_backward(grad, x.detach(), w.detach(), z.detach(), 1e-6, zero_centered)
    for got, want in ((dx, x.grad), (dw, w.grad), (dz, z.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gated_is_norm_times_silu_of_gate():
    """The gated norm rounds the norm to the input's dtype before the gate, as the norm module followed
    by the gate's product computes it (HF's gated RMSNorm casts the norm back as well)."""
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    z = torch.randn(6, 64, dtype=torch.bfloat16)
    norm = rn.naive(x, w, 1e-6, True)
    want = (norm.float() * torch.nn.functional.silu(z.float())).to(torch.bfloat16)
    assert torch.equal(rn.gated_rms_norm(x, w, z, 1e-6, zero_centered=True), want)
    dx, dw, dz = rn._gated_backward(torch.ones_like(x), x, w, z, 1e-6, True)
    assert (dx.dtype, dw.dtype, dz.dtype) == (torch.bfloat16,) * 3


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
def test_gpu_kernel_equals_naive(zero_centered):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (1000, 24576):
        x = torch.randn(tokens, 2048, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
        w = (torch.randn(2048, generator=gen, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
        grad = torch.randn(tokens, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        assert_op_no_worse(
            f"rms_norm zero_centered={zero_centered} rows={tokens}", rn.rms_norm, rn.naive, (x, w), grad, 1e-6, zero_centered
        )


@pytest.mark.gpu
@pytest.mark.parametrize("zero_centered", [False, True])
def test_gpu_gated_kernel_equals_naive(zero_centered):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for rows in (3000, 98304):  # Gated DeltaNet's per-head rows: tokens x value heads
        x = torch.randn(rows, 128, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
        w = (torch.randn(128, generator=gen, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
        z = (torch.randn(rows, 128, generator=gen, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
        grad = torch.randn(rows, 128, generator=gen, device="cuda").to(torch.bfloat16)
        assert_op_no_worse(
            f"gated rms_norm zero_centered={zero_centered} rows={rows}", rn.gated_rms_norm, rn.naive_gated, (x, w, z), grad,
            1e-6, zero_centered,
        )
