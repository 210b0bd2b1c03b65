"""`cudnn.DenseSplitKernel`: a varlen call's long elements on a dense kernel (cuDNN on the GPU), padded to
multiples of the quantum, non-causal keys cut with a flash tail merged by log-sum-exp, the rest on flash.

CPU (CI): the dense kernel is torch's CPU flash op on `[1, H, L, D]` inputs (what cuDNN's op takes and
returns, top-left causal), with a small quantum and threshold, so the split, the padding, the tails and
the merged-output backward are checked exactly (float64) against the plain kernel on the whole call,
and under the cascade against `torch_ref`. GPU (marker `gpu`): cuDNN itself, bf16 against the float32
reference and no farther from it than flash.
"""

from __future__ import annotations

import pytest
import torch

from ps_bridge.kernels.attention import cascade, cudnn, kernel_choice
from ps_bridge.kernels.attention.cudnn import DensePiece, DenseSplitKernel, VarlenPiece, split_call
from ps_bridge.kernels.attention.varlen import CpuFlashKernel, VarlenCall

aten = torch.ops.aten


class CpuDense:
    """The dense op's contract on a CPU: `[1, H, L, D]` in, out `[1, H, Lq, D]`, lse `[1, H, Lq, 1]`."""

    calls = []

    @staticmethod
    def _kv(q, x):
        return x.repeat_interleave(q.shape[1] // x.shape[1], dim=1).contiguous()

    @classmethod
    def forward(cls, q, k, v, causal, scale):
        cls.calls.append((q.shape[2], k.shape[2], causal))
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q.contiguous(), cls._kv(q, k), cls._kv(q, v), 0.0,
                                                                   causal, scale=scale)[:2]
        return o, lse.unsqueeze(-1), None

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale, aux):
        assert lse.shape == (1, q.shape[1], q.shape[2], 1) and lse.is_contiguous()
        gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q.contiguous(), cls._kv(q, k), cls._kv(q, v), out.contiguous(), lse[..., 0], 0.0,
            causal, scale=scale)
        rep = q.shape[1] // k.shape[1]
        fold = lambda g: g.view(1, k.shape[1], rep, *g.shape[2:]).sum(2)  # noqa: E731
        return gq, fold(gk), fold(gv)


def split_kernel(quantum=4, min_work=30):
    CpuDense.calls = []
    return DenseSplitKernel(CpuFlashKernel(), dense=CpuDense, quantum=quantum, min_work=min_work, takes=lambda q: True)


def offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


CALLS = [
    # causal: long elements (padded to the quantum, or already multiples) among short ones
    ("causal, long and short", [9, 2, 3, 12, 1, 7], [9, 2, 3, 12, 1, 7], True),
    ("causal, all long", [8, 11], [8, 11], True),
    ("causal, all short", [2, 3, 1], [2, 3, 1], True),
    ("bottom-right causal stays on flash", [3, 9], [10, 12], True),
    # non-causal (an ancestor level): long elements with key tails, keys-only elements, short ones
    ("ancestor, tails and keys-only", [10, 0, 2, 7, 0], [9, 3, 4, 13, 2], False),
    ("ancestor, keys a multiple", [12, 1], [8, 2], False),
]


@pytest.mark.parametrize("name,lq,lk,causal", CALLS, ids=[c[0] for c in CALLS])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 3)])
def test_split_kernel_equals_the_plain_kernel(name, lq, lk, causal, hq, hkv):
    """Output, log-sum-exp and the backward (from given, perturbed output and log-sum-exp, as the cascade
    passes merged ones) equal the plain kernel's on the whole call, float64."""
    call = VarlenCall(cu_q=offsets(lq), cu_k=offsets(lk), causal=causal)
    g = torch.Generator().manual_seed(len(name))
    d = 8
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn_like(q)
    plain, split = CpuFlashKernel(), split_kernel()
    out_ref, lse_ref, aux_ref = plain.forward(q, k, v, call, 0.3)
    out, lse, aux = split.forward(q, k, v, call, 0.3)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    # a backward with another output/lse than the call's own (the cascade's merged values)
    out_m = out_ref + 0.1 * torch.randn(out_ref.shape, generator=g, dtype=torch.float64)
    lse_m = lse_ref + 0.5 * torch.rand(lse_ref.shape, generator=g, dtype=torch.float64)
    ref = plain.backward(dout, q, k, v, out_m, lse_m, call, 0.3, aux_ref)
    got = split.backward(dout, q, k, v, out_m, lse_m, call, 0.3, aux)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    pieces = split_call(call, 4, 30)
    dense = [p for p in pieces if isinstance(p, DensePiece)]
    assert len(CpuDense.calls) == len(dense)  # one dense forward per dense piece
    assert all(lq_ % 4 == 0 and lk_ % 4 == 0 for lq_, lk_, _ in CpuDense.calls)


def test_the_split_of_a_call():
    """Dense pieces where an element has enough work (causal: square), padded up to the quantum
    (non-causal keys cut down, the rest a tail); consecutive other elements one varlen run, rebased."""
    call = VarlenCall(cu_q=offsets([9, 2, 3, 12]), cu_k=offsets([9, 2, 3, 12]), causal=True)
    p = split_call(call, quantum=4, min_work=30)
    assert [type(x).__name__ for x in p] == ["DensePiece", "VarlenPiece", "DensePiece"]
    assert (p[0].lq_pad, p[0].lk_dense, p[0].tail) == (12, 12, None)
    assert (p[1].qa, p[1].qb, p[1].call.cu_q, p[1].call.cu_k) == (9, 14, [0, 2, 5], [0, 2, 5])
    assert (p[2].qa, p[2].lq_pad, p[2].lk_dense) == (14, 12, 12)
    ancestor = VarlenCall(cu_q=offsets([10, 0]), cu_k=offsets([9, 3]), causal=False)
    p = split_call(ancestor, quantum=4, min_work=30)
    assert len(p) == 1 and isinstance(p[0], DensePiece)  # the keys-only element computes nothing
    assert (p[0].lq_pad, p[0].lk_dense, p[0].tail.cu_k) == (12, 8, [0, 1])
    # too little work, or a bottom-right causal element: flash
    assert all(isinstance(x, VarlenPiece) for x in split_call(VarlenCall([0, 3, 12], [0, 10, 22], True), 4, 30))


def test_the_split_kernel_defers_to_flash_where_the_dense_kernel_does_not_take_the_inputs():
    call = VarlenCall(cu_q=[0, 12], cu_k=[0, 12], causal=True)
    q = torch.randn(12, 2, 8, dtype=torch.float64)
    kernel = DenseSplitKernel(CpuFlashKernel(), dense=CpuDense, quantum=4, min_work=30, takes=lambda q: False)
    CpuDense.calls = []
    out, _, _ = kernel.forward(q, q, q, call, 0.3)
    assert CpuDense.calls == []
    assert not cudnn.dense_takes(torch.zeros(1, 1, 256, dtype=torch.bfloat16))  # Qwen3.5's head dim: flash
    assert cudnn.dense_takes(torch.zeros(1, 1, 128, dtype=torch.bfloat16))
    assert not cudnn.dense_takes(torch.zeros(1, 1, 128, dtype=torch.float32))


def test_no_split_kernel_off_cuda():
    assert cudnn.cudnn_dense_available(torch.device("cpu")) == (False, "not a CUDA device")
    assert kernel_choice.kernel_for(torch.device("cpu")).name == "cpu"


@pytest.mark.parametrize("seed,pad", [(0, 1), (1, 3), (6, 4)])
def test_cascade_on_the_split_kernel_matches_reference(monkeypatch, seed, pad):
    """The tree cascade (and so the unshared and one-level paths, its special cases) with the split
    kernel: outputs and q/k/v gradients equal torch_ref's, float64."""
    from test_attention_backends import check_float64_against_reference, make_layout, tree_layout

    kernel = split_kernel(quantum=2, min_work=9)
    monkeypatch.setattr(cascade, "kernel_for", lambda device, dense=True: kernel if dense else CpuFlashKernel())
    for layout in (tree_layout(seed, pad), make_layout("shared", pad, seed=seed), make_layout("unshared", pad, seed=seed)):
        CpuDense.calls = []
        check_float64_against_reference("flash_atten_gpu", layout, 4, 2, 32, seed=seed)
        assert CpuDense.calls, "no element ran on the dense kernel"


# ---- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["shared", "unshared"])
def test_gpu_cudnn_split_bf16_no_farther_from_fp32_than_flash(kind):
    """Long prompts (dense pieces with padding and key tails) on cuDNN, bf16: within the bound of the
    flash test against the float32 reference, and within 1.25x of flash's own error."""
    from test_attention_backends import make_layout, qkv, rel_err, run

    if not cudnn.cudnn_dense_available(torch.device("cuda"))[0]:
        pytest.skip(cudnn.cudnn_dense_available(torch.device("cuda"))[1])
    assert kernel_choice.kernel_for(torch.device("cuda")).name.startswith("cudnn+")
    layout = make_layout(kind, 1, seed=3, prompt=(2100, 2700), response=(1, 700), groups=2, n=(2, 4)).to("cuda")
    q, k, v = qkv(layout, 8, 2, 128, torch.bfloat16, device="cuda")
    grad_out = torch.randn(q.shape, dtype=torch.bfloat16, device="cuda")
    ref, ref_grads = run("torch_ref", q.float(), k.float(), v.float(), layout, grad_out.float())
    results = {}
    for on in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(on)
        try:
            results[on] = run("flash_atten_gpu", q, k, v, layout, grad_out)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    valid = layout.valid
    (out, grads), (out_f, grads_f) = results[True], results[False]
    e, e_f = rel_err(out[valid], ref[valid]), rel_err(out_f[valid], ref[valid])
    assert e < 1e-2 and e <= 1.25 * e_f, (e, e_f)
    for name, g, gf, r in zip("qkv", grads, grads_f, ref_grads):
        e, e_f = rel_err(g, r), rel_err(gf, r)
        assert e < 2e-2 and e <= 1.25 * e_f, (name, e, e_f)
