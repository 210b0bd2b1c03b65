"""`flash_atten_npu` against torch_ref, with a plain-PyTorch stand-in for torch_npu's
`npu_fusion_attention` that follows its documented semantics (TND layout, cumulative ends without a
leading 0, sparse_mode=3 = bottom-right causal). This checks our plumbing (gather, lengths, scale,
GQA, padding); the NPU kernel itself is unverified."""

import math
import sys
import types

import pytest
import torch

from ps_bridge.kernels.attention import get_attention_backend
from ps_bridge.layout import Sample, build_layout


def fake_npu_fusion_attention(query, key, value, head_num, input_layout, *, scale=1.0, sparse_mode=0,
                              atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    assert input_layout == "TND" and sparse_mode == 3
    assert atten_mask.dtype == torch.bool and atten_mask.shape == (2048, 2048)
    assert torch.equal(atten_mask, torch.triu(torch.ones_like(atten_mask), 1))
    assert head_num == query.shape[1] and len(actual_seq_qlen) == len(actual_seq_kvlen)
    rep = query.shape[1] // key.shape[1]
    outs, qa, ka = [], 0, 0
    for qb, kb in zip(actual_seq_qlen, actual_seq_kvlen):
        q, k, v = query[qa:qb].transpose(0, 1), key[ka:kb].transpose(0, 1), value[ka:kb].transpose(0, 1)
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        lq, lk = qb - qa, kb - ka
        allowed = torch.arange(lk)[None, :] <= (lk - lq) + torch.arange(lq)[:, None]  # bottom-right
        scores = (q @ k.transpose(1, 2)) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append((probs @ v).transpose(0, 1))
        qa, ka = qb, kb
    return (torch.cat(outs),)


@pytest.fixture
def fake_torch_npu(monkeypatch):
    module = types.ModuleType("torch_npu")
    module.npu_fusion_attention = fake_npu_fusion_attention
    monkeypatch.setitem(sys.modules, "torch_npu", module)


CASES = [
    [Sample([1, 2, 3, 4, 5], [6, 7, 8]), Sample([1, 2, 3, 4, 5], [9]), Sample([3, 3], [1, 2, 3, 4]), Sample([3, 3], [5, 6])],
    [Sample([4], [1, 2]), Sample([4], [3])],
    [Sample([1, 2], [3]), Sample([2, 1], [3, 4])],
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_npu_backend_matches_torch_ref(fake_torch_npu, case, pad_multiple, heads):
    torch.manual_seed(case)
    layout = build_layout(CASES[case], pad_multiple=pad_multiple)
    T, (hq, hkv), D = layout.num_tokens, heads, 8
    q = torch.randn(T, hq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, hkv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, hkv, D, dtype=torch.float64, requires_grad=True)
    scale = 1 / math.sqrt(D)
    got = get_attention_backend("flash_atten_npu")(q, k, v, layout, scale)
    ref = get_attention_backend("torch_ref")(q, k, v, layout, scale)
    valid = layout.valid
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-10, atol=1e-10)
    w = torch.randn(valid.sum(), hq, D, dtype=torch.float64)
    g_got = torch.autograd.grad((got[valid] * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref[valid] * w).sum(), (q, k, v))
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_npu_backend_without_torch_npu_says_what_to_use(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    layout = build_layout([Sample([1, 2], [3])])
    x = torch.zeros(layout.num_tokens, 2, 4)
    with pytest.raises(RuntimeError, match="needs torch_npu.*flash_atten_gpu"):
        get_attention_backend("flash_atten_npu")(x, x, x, layout, 0.5)
