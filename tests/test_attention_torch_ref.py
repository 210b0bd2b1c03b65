"""The torch_ref prefix-shared attention against a per-sample dense causal reference."""

import math

import pytest
import torch

from ps_bridge.kernels.attention import get_attention_backend
from ps_bridge.layout import Sample, build_layout


def per_sample_reference(q, k, v, layout, samples, scale):
    """Unshared attention: for each sample gather its own sequence (prompt + response) from the pack
    and run plain causal SDPA; returns a list of [L, Hq, D] outputs in row order."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for i in range(len(samples)):
        a, b = int(layout.row_offsets[i]), int(layout.row_offsets[i + 1])
        idx = layout.row_source[a:b]
        qi, ki, vi = (x.index_select(0, idx).transpose(0, 1) for x in (q, k, v))
        ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1))
    return outs


CASES = {
    "grpo": [Sample([1, 2, 3, 4, 5], [6, 7, 8]), Sample([1, 2, 3, 4, 5], [9]), Sample([3, 3], [1, 2, 3, 4]), Sample([3, 3], [5, 6])],
    "one_token_prompt": [Sample([4], [1, 2]), Sample([4], [3])],
    "no_sharing": [Sample([1, 2], [3]), Sample([2, 1], [3, 4])],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_torch_ref_matches_per_sample_causal_attention(case, pad_multiple, heads):
    torch.manual_seed(0)
    samples = CASES[case]
    layout = build_layout(samples, pad_multiple=pad_multiple)
    T, (hq, hkv), D = layout.num_tokens, heads, 8
    q = torch.randn(T, hq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, hkv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, hkv, D, dtype=torch.float64, requires_grad=True)
    scale = 1 / math.sqrt(D)
    out = get_attention_backend("torch_ref")(q, k, v, layout, scale)
    refs = per_sample_reference(q, k, v, layout, samples, scale)

    # every sample's row reads its own (shared) packed positions: outputs must agree
    g = torch.Generator().manual_seed(1)
    loss_shared, loss_ref = 0.0, 0.0
    for i, ref in enumerate(refs):
        a, b = int(layout.row_offsets[i]), int(layout.row_offsets[i + 1])
        got = out.index_select(0, layout.row_source[a:b])
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
        w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        # the loss only weights response tokens once each (and prompts once per group via sample 0),
        # so it is the same function of q, k, v for both sides
        P = len(samples[i].prompt)
        loss_shared = loss_shared + (got[P:] * w[P:]).sum()
        loss_ref = loss_ref + (ref[P:] * w[P:]).sum()
    gs = torch.autograd.grad(loss_shared, (q, k, v))
    gr = torch.autograd.grad(loss_ref, (q, k, v))
    for a_, b_ in zip(gs, gr):
        torch.testing.assert_close(a_, b_, rtol=1e-10, atol=1e-10)


def test_padding_keys_are_never_attended():
    samples = [Sample([1, 2, 3], [4, 5]), Sample([1, 2, 3], [6])]
    layout = build_layout(samples, pad_multiple=4)
    T = layout.num_tokens
    torch.manual_seed(0)
    q, k, v = (torch.randn(T, 2, 4, dtype=torch.float64) for _ in range(3))
    out = get_attention_backend("torch_ref")(q, k, v, layout, 0.5)
    v2 = v.clone()
    v2[~layout.valid] = 1e6  # poison the padding values
    k2 = k.clone()
    k2[~layout.valid] = 1e3
    out2 = get_attention_backend("torch_ref")(q, k2, v2, layout, 0.5)
    assert torch.equal(out[layout.valid], out2[layout.valid])
    assert torch.isfinite(out2).all()


def test_response_does_not_see_sibling_response():
    """Changing response 2's keys/values must not change response 1's outputs."""
    samples = [Sample([1, 2, 3], [4, 5, 6]), Sample([1, 2, 3], [7, 8])]
    layout = build_layout(samples)
    torch.manual_seed(0)
    T = layout.num_tokens
    q, k, v = (torch.randn(T, 2, 4, dtype=torch.float64) for _ in range(3))
    out = get_attention_backend("torch_ref")(q, k, v, layout, 0.5)
    sibling = layout.segment_ids == int(layout.sample_segment[1])
    v2 = v.clone()
    v2[sibling] += 1.0
    out2 = get_attention_backend("torch_ref")(q, k, v2, layout, 0.5)
    mine = layout.segment_ids == int(layout.sample_segment[0])
    assert torch.equal(out[mine], out2[mine])
    assert not torch.equal(out[sibling], out2[sibling])


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match="valid backends: .*torch_ref"):
        get_attention_backend("nope")
