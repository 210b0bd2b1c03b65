"""Gated DeltaNet with forked prompt states == one unshared run (torch_ref, CPU, float64).

Outputs and gradients of every leaf (conv weight/bias, each prompt's and each response's inputs)
are compared; THD (packed layout, padding at segment ends) and bshd (padded rows + row map).
"""

import pytest
import torch

from gdn_cases import make_case, packed_inputs, sample_outputs
from ps_bridge.kernels.gdn import (
    forked_gated_delta_rule,
    plan_from_layout,
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


class _SumBackend:
    """A delta rule of plain differentiable arithmetic: what reaches the backward graph is the wiring's."""

    @staticmethod
    def gated_delta_rule(q, k, v, g, beta, scale, cu, cu_host, initial_state, output_final_state, chunk_index=None):
        o = v * (g * beta).unsqueeze(-1) + (q.sum() + k.sum()) * scale
        states = o.sum() * torch.ones(cu.numel() - 1, 1, dtype=o.dtype)
        return o, states if initial_state is None else states + initial_state.sum()


def _backward_node_names(out):
    names, seen, stack = [], set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("share", [True, False])
def test_each_delta_rule_input_is_split_once_not_sliced_per_level(share):
    """The levels tile the compacted tokens, so each of q, k, v, g, beta is split once (its backward
    one cat); a slice per level would zero-fill the input's whole gradient for every level."""
    case = make_case()
    layout = build_layout(case.samples, share=share, pad_multiple=1)
    plan = plan_from_layout(layout)
    L, gen = plan.levels[-1].end, torch.Generator().manual_seed(1)
    H, K, HV, V = case.num_key_heads, case.key_head_dim, case.num_value_heads, case.value_head_dim
    q, k = (torch.randn(L, H, K, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(L, HV, V, generator=gen, dtype=torch.float64, requires_grad=True)
    g, beta = (torch.rand(L, HV, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = forked_gated_delta_rule(q, k, v, g, beta, K**-0.5, plan, _SumBackend())
    names = _backward_node_names(out)
    assert len(plan.levels) == (2 if share else 1)
    assert "SliceBackward0" not in names
    assert names.count("SplitWithSizesBackward0") == (5 if share else 0)
    with pytest.raises(ValueError, match="levels cover tokens"):
        forked_gated_delta_rule(q[1:], k[1:], v[1:], g[1:], beta[1:], K**-0.5, plan, _SumBackend())


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
