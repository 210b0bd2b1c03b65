"""Gated DeltaNet with forked prompt states == one unshared run (torch_ref, CPU, float64).

Outputs and gradients of every leaf (conv weight/bias, each prompt's and each response's inputs)
are compared; THD (packed layout, padding at segment ends) and bshd (padded rows + row map).
"""

import pytest
import torch

from gdn_cases import make_case, packed_inputs, sample_outputs
from ps_bridge.kernels.gdn import (
    plan_from_layout,
    plan_from_rows,
    prefix_shared_gated_delta_net,
    resolve_gdn_backend,
)
from ps_bridge.layout import build_layout

REF = resolve_gdn_backend("torch_ref", torch.device("cpu"))


def run_thd(case, layout, fork=True):
    mixed, g, beta = packed_inputs(case, layout)
    plan = plan_from_layout(layout)
    return prefix_shared_gated_delta_net(
        mixed, g, beta, case.conv_weight, case.conv_bias, plan, REF,
        num_key_heads=case.num_key_heads, key_head_dim=case.key_head_dim,
        value_head_dim=case.value_head_dim, fork=fork,
    )


def weighted_loss(case, per_sample, weights):
    return sum((o * w).sum() for o, w in zip(per_sample, weights))


def grads(case, loss):
    return torch.autograd.grad(loss, case.leaves(), allow_unused=False)


def compare(case, shared_layout, unshared_layout, fork=True):
    out_s = sample_outputs(run_thd(case, shared_layout, fork=fork), shared_layout)
    out_u = sample_outputs(run_thd(case, unshared_layout), unshared_layout)
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in out_u]
    g_s = grads(case, weighted_loss(case, out_s, weights))
    g_u = grads(case, weighted_loss(case, out_u, weights))
    out_diff = max((a - b).abs().max().item() for a, b in zip(out_s, out_u))
    grad_diff = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in zip(g_s, g_u))
    return out_diff, grad_diff


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_thd_fork_equals_unshared(pad_multiple):
    case = make_case()
    shared = build_layout(case.samples, share=True, pad_multiple=pad_multiple)
    unshared = build_layout(case.samples, share=False, pad_multiple=pad_multiple)
    assert shared.has_sharing
    out_diff, grad_diff = compare(case, shared, unshared)
    assert out_diff < 1e-12, out_diff
    assert grad_diff < 1e-12, grad_diff


def test_thd_without_fork_differs():
    """Negative check: responses that start from zero states do not match the unshared run."""
    case = make_case()
    shared = build_layout(case.samples, share=True, pad_multiple=4)
    unshared = build_layout(case.samples, share=False, pad_multiple=4)
    out_diff, _ = compare(case, shared, unshared, fork=False)
    assert out_diff > 1e-3


def test_thd_padding_garbage_is_ignored():
    case = make_case()
    layout = build_layout(case.samples, share=True, pad_multiple=8)
    plan = plan_from_layout(layout)
    outs = []
    for pad_value in (0.0, 1e3):
        mixed, g, beta = packed_inputs(case, layout, pad_value=pad_value)
        outs.append(prefix_shared_gated_delta_net(
            mixed, g, beta, case.conv_weight, case.conv_bias, plan, REF,
            num_key_heads=case.num_key_heads, key_head_dim=case.key_head_dim, value_head_dim=case.value_head_dim))
    assert torch.equal(outs[0], outs[1])
    assert torch.all(outs[0][~layout.valid] == 0)


def test_groups_of_one_and_no_sharing():
    case = make_case(group_sizes=(1, 1, 1), prompt_lens=(4, 9, 2))
    shared = build_layout(case.samples, share=True, pad_multiple=2)
    unshared = build_layout(case.samples, share=False, pad_multiple=2)
    assert not shared.has_sharing
    out_diff, grad_diff = compare(case, shared, unshared)
    assert out_diff < 1e-12 and grad_diff < 1e-12


def test_prompt_shorter_than_conv_width():
    """A 1-token prompt leaves a conv state that is mostly zeros: the fork must still be exact."""
    case = make_case(group_sizes=(2, 2), prompt_lens=(1, 2), response_lens=[1, 6, 3, 2])
    shared = build_layout(case.samples, share=True, pad_multiple=3)
    unshared = build_layout(case.samples, share=False, pad_multiple=3)
    out_diff, grad_diff = compare(case, shared, unshared)
    assert out_diff < 1e-12 and grad_diff < 1e-12


def bshd_rows(case, rows, width):
    """Stack (mixed, g, beta) row sources into right-padded [B, width, ...] tensors."""
    out = []
    for j in range(3):
        padded = []
        for src in rows:
            t = src[j]
            pad = torch.full((width - t.shape[0], t.shape[1]), -3.0, dtype=t.dtype)
            padded.append(torch.cat([t, pad]))
        out.append(torch.stack(padded))
    return out


def run_bshd(case, rows, response_prompt_row):
    width = max(r[0].shape[0] for r in rows) + 2
    mixed, g, beta = bshd_rows(case, rows, width)
    B = len(rows)
    plan = plan_from_rows([r[0].shape[0] for r in rows], width, response_prompt_row, device="cpu")
    o = prefix_shared_gated_delta_net(
        mixed.reshape(B * width, -1), g.reshape(B * width, -1), beta.reshape(B * width, -1),
        case.conv_weight, case.conv_bias, plan, REF,
        num_key_heads=case.num_key_heads, key_head_dim=case.key_head_dim, value_head_dim=case.value_head_dim)
    o = o.reshape(B, width, *o.shape[1:])
    return [o[b, : rows[b][0].shape[0]] for b in range(B)]


def test_bshd_fork_equals_unshared():
    case = make_case()
    G = len(case.prompt_leaves)
    # rows: responses interleaved before their prompts on purpose (the map decides, not the order)
    rows, row_map = [], []
    for i, r in enumerate(case.response_leaves):
        rows.append(r)
        row_map.append(None)
    prompt_row = {}
    for g_idx, p in enumerate(case.prompt_leaves):
        prompt_row[g_idx] = len(rows)
        rows.append(p)
        row_map.append(-1)
    row_map = [prompt_row[case.sample_group[i]] if m is None else m for i, m in enumerate(row_map)]
    shared_rows = run_bshd(case, rows, row_map)
    unshared_rows = run_bshd(case, [case.sample_inputs(i) for i in range(len(case.samples))], [-1] * len(case.samples))
    gen = torch.Generator().manual_seed(1)
    per_sample_shared, weights = [], []
    for i in range(len(case.samples)):
        p = shared_rows[prompt_row[case.sample_group[i]]]
        per_sample_shared.append(torch.cat([p, shared_rows[i]]))
        weights.append(torch.randn(unshared_rows[i].shape, generator=gen, dtype=torch.float64))
    out_diff = max((a - b).abs().max().item() for a, b in zip(per_sample_shared, unshared_rows))
    assert out_diff < 1e-12
    g_s = grads(case, weighted_loss(case, per_sample_shared, weights))
    g_u = grads(case, weighted_loss(case, unshared_rows, weights))
    for a, b in zip(g_s, g_u):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()
    assert G == 3


def test_bshd_rejects_bad_map():
    with pytest.raises(ValueError, match="not a prompt row"):
        plan_from_rows([3, 2, 2], 4, [-1, 2, 0], device="cpu")


def test_backend_resolution():
    assert resolve_gdn_backend("auto", torch.device("cpu")).name == "torch_ref"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_gdn_backend("fla", torch.device("cpu"))
    with pytest.raises(ValueError, match="valid backends"):
        resolve_gdn_backend("nope", torch.device("cpu"))


def test_torch_ref_matches_transformers_reference():
    """Independent definition: transformers' own recurrent gated delta rule and F.conv1d causal conv."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(3)
    L, H, HV, K, V, D, W = 9, 2, 4, 5, 3, 7, 4
    q, k = torch.randn(L, H, K, generator=gen, dtype=torch.float64), torch.randn(L, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(L, HV, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(L, HV, generator=gen, dtype=torch.float64)
    beta = torch.rand(L, HV, generator=gen, dtype=torch.float64)
    h0 = torch.randn(1, HV, K, V, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, L])
    o, hT = REF.gated_delta_rule(q, k, v, g, beta, K**-0.5, cu, [0, L], h0, True)
    rep = HV // H
    o_hf, hT_hf = torch_recurrent_gated_delta_rule(
        q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None], v[None], g[None], beta[None],
        initial_state=h0, output_final_state=True)
    # transformers' reference computes in float32
    assert (o - o_hf[0]).abs().max() < 1e-5 and (hT - hT_hf).abs().max() < 1e-5

    x = torch.randn(L, D, generator=gen, dtype=torch.float64)
    w = torch.randn(D, W, generator=gen, dtype=torch.float64)
    y, state = REF.causal_conv1d(x, w, None, cu, [0, L], None, True, "silu")
    conv = torch.nn.functional.conv1d(x.T[None], w[:, None, :], padding=W - 1, groups=D)[0, :, :L]
    assert (y - torch.nn.functional.silu(conv).T).abs().max() < 1e-12
    assert torch.equal(state[0], x[-W:].T)
