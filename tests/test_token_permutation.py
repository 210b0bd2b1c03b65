"""Token permutation without scatter-adds (`models/token_permutation.py`): the gather and the
segmented sum equal megatron's `permute` / `unpermute` (index_select + index_add_, scatter_add_) in
value and gradient, tokens routed to no local expert included, and the Qwen3.5 MoE layers use it."""

import torch

from ps_bridge.models.token_permutation import (
    GatherSumPermutation,
    permute_with_bags,
    token_bags,
    unpermute_with_bags,
)


def _routing(num_tokens=13, num_experts=5, topk=2, seed=0, drop_expert=None):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, scores.topk(topk, dim=1).indices, True)
    if drop_expert is not None:  # a rank's local experts only: some tokens have no row at all
        routing_map[:, drop_expert] = False
    # megatron's argsort-based permutation: rows grouped by expert, tokens in order within each
    flat = routing_map.T.contiguous().reshape(-1).argsort(descending=True, stable=True)[: int(routing_map.sum())]
    return flat % num_tokens


def test_gather_sum_equals_index_select_and_scatter_add():
    for drop in (None, [1, 2, 3]):
        sorted_indices = _routing(drop_expert=drop)
        T, H = 13, 7
        bags = token_bags(sorted_indices, T)
        x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        y = permute_with_bags(x, x.detach().index_select(0, sorted_indices), bags)
        y_ref = x_ref.index_select(0, sorted_indices)  # backward: index_add_
        assert torch.equal(y, y_ref)
        back = unpermute_with_bags(y * 1.5, bags)
        back_ref = torch.zeros(T, H, dtype=torch.float64).scatter_add_(
            0, sorted_indices.unsqueeze(1).expand(-1, H), y_ref * 1.5)
        assert torch.allclose(back, back_ref, atol=1e-12, rtol=0)
        g = torch.randn(T, H, dtype=torch.float64)
        back.backward(g)
        back_ref.backward(g)
        assert torch.allclose(x.grad, x_ref.grad, atol=1e-12, rtol=0)
        if drop is not None:  # tokens without local rows get exact zeros
            missing = torch.ones(T, dtype=torch.bool)
            missing[sorted_indices] = False
            assert missing.any() and back[missing].abs().max() == 0 and x.grad[missing].abs().max() == 0


def test_gradcheck():
    sorted_indices = _routing(num_tokens=6, num_experts=4, topk=2, seed=3)
    bags = token_bags(sorted_indices, 6)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: unpermute_with_bags(permute_with_bags(t, t.detach().index_select(0, sorted_indices), bags) ** 2, bags), (x,))


def test_qwen35_moe_layers_use_it(tmp_path_factory):
    from qwen35_helpers import load_tiny

    _, loaded, _ = load_tiny("qwen3.5-moe", tmp_path_factory)
    layers = [m for m in loaded.model.modules() if hasattr(m, "token_dispatcher")]
    assert layers and all(isinstance(m.token_dispatcher, GatherSumPermutation) for m in layers)


def test_bf16_combine_no_less_exact_than_scatter_add():
    """In bf16 the segmented sum accumulates in float32 and rounds once; megatron's scatter_add_
    rounds after every add. Against the float64 sum ours is no farther off."""
    sorted_indices = _routing(num_tokens=64, num_experts=16, topk=8, seed=5)
    H = 256
    bags = token_bags(sorted_indices, 64)
    routed = torch.randn(sorted_indices.numel(), H, dtype=torch.float64)
    exact = torch.zeros(64, H, dtype=torch.float64).index_add_(0, sorted_indices, routed)
    r16 = routed.to(torch.bfloat16)
    exact16 = torch.zeros(64, H, dtype=torch.float64).index_add_(0, sorted_indices, r16.double())  # rounded inputs
    ours = unpermute_with_bags(r16, bags).double()
    theirs = torch.zeros(64, H, dtype=torch.bfloat16).scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, H), r16).double()
    err_ours = (ours - exact16).norm() / exact.norm()
    err_theirs = (theirs - exact16).norm() / exact.norm()
    assert err_ours <= err_theirs, (err_ours, err_theirs)
