"""Token permutation without scatter-adds (`models/token_permutation.py`): the gather and the
segmented sum equal megatron's `permute` / `unpermute` (index_select + index_add_, scatter_add_) in
value and gradient, tokens routed to no local expert included, and the Qwen3.5 MoE layers use it."""

import pytest
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


@pytest.mark.parametrize("fixed_size", [False, True])
def test_gather_sum_equals_index_select_and_scatter_add(fixed_size):
    for drop in (None, [1, 2, 3]):
        if fixed_size and drop is not None:
            continue  # bags of one size: top-k over all experts
        sorted_indices = _routing(drop_expert=drop)
        T, H = 13, 7
        bags = token_bags(sorted_indices, T, 2 if fixed_size else None)
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


def test_bags_of_one_size_are_checked():
    """A wrong bag size stops the run (a device-side assertion; on the CPU at once), never a wrong sum."""
    sorted_indices = _routing(num_tokens=13, num_experts=5, topk=2)
    with pytest.raises(ValueError, match="not 3 per token"):
        token_bags(sorted_indices, 13, 3)
    uneven = _routing(num_tokens=13, num_experts=5, topk=2, drop_expert=[1])
    uneven = torch.cat([uneven, uneven[: 26 - uneven.numel()]])  # 26 rows, but not 2 per token
    with pytest.raises(RuntimeError, match="not 2 rows each"):
        token_bags(uneven, 13, 2)


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


@pytest.mark.parametrize("fixed_size", [False, True])
def test_bf16_combine_no_less_exact_than_scatter_add(fixed_size):
    """In bf16 the segmented sum (embedding_bag, or the sum over bags of one size) accumulates in
    float32 and rounds once; megatron's scatter_add_ rounds after every add. Against the float64 sum
    ours is no farther off."""
    sorted_indices = _routing(num_tokens=64, num_experts=16, topk=8, seed=5)
    H = 256
    bags = token_bags(sorted_indices, 64, 8 if fixed_size else None)
    routed = torch.randn(sorted_indices.numel(), H, dtype=torch.float64)
    exact = torch.zeros(64, H, dtype=torch.float64).index_add_(0, sorted_indices, routed)
    r16 = routed.to(torch.bfloat16)
    exact16 = torch.zeros(64, H, dtype=torch.float64).index_add_(0, sorted_indices, r16.double())  # rounded inputs
    ours = unpermute_with_bags(r16, bags).double()
    theirs = torch.zeros(64, H, dtype=torch.bfloat16).scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, H), r16).double()
    err_ours = (ours - exact16).norm() / exact.norm()
    err_theirs = (theirs - exact16).norm() / exact.norm()
    assert err_ours <= err_theirs, (err_ours, err_theirs)


def _layer_step(layer, x, grad):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, _ = layer(x)
    out.backward(grad)
    params = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, params


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the alltoall dispatcher needs CUDA")
def test_gpu_alltoall_layer_equals_megatrons_permutation():
    """The MoE layer on the GPU (alltoall dispatcher, EP = TP = 1: chunk sort skipped), float32:
    output, input gradient and every parameter gradient equal the same layer with megatron's own
    permutation (the dispatcher switched back to megatron's class)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from ps_bridge.tools.bench.catalog import FAMILIES, MODEL_SHAPES
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.models.token_permutation import GatherSumAlltoAllTokenDispatcher, use_megatron_permutation
    from ps_bridge.tools.runtime import load_model_from_hf_config

    shape = MODEL_SHAPES["tiny-qwen3.5-moe"]
    loaded = load_model_from_hf_config(FAMILIES[shape.family](shape.dims, 1), PrefixSharingConfig(enabled=True),
                                       dtype=torch.float32)
    layer = loaded.model.decoder.layers[0].mlp
    assert type(layer.token_dispatcher) is GatherSumAlltoAllTokenDispatcher
    assert layer.token_dispatcher._chunk_sort_is_identity()
    gen = torch.Generator(device=loaded.device).manual_seed(0)
    hidden = int(loaded.provider.hidden_size)
    x = torch.randn(300, 1, hidden, generator=gen, device=loaded.device)
    grad = torch.randn(300, 1, hidden, generator=gen, device=loaded.device)
    ours = _layer_step(layer, x, grad)
    use_megatron_permutation(layer.token_dispatcher)
    assert type(layer.token_dispatcher) is MoEAlltoAllTokenDispatcher
    theirs = _layer_step(layer, x, grad)

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp(min=1e-30))

    assert rel(ours[0], theirs[0]) < 1e-5 and rel(ours[1], theirs[1]) < 1e-5
    assert ours[2].keys() == theirs[2].keys() and len(ours[2]) > 3
    for name in ours[2]:
        assert rel(ours[2][name], theirs[2][name]) < 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the alltoall dispatcher needs CUDA")
def test_gpu_moe_layer_runs_without_a_host_sync():
    """bf16 on the GPU at EP = TP = 1 (grouped experts, alltoall dispatcher, chunk sort skipped): a
    forward + backward of the MoE layer never makes the host wait for the GPU. megatron's own
    dispatcher waits for the token counts' host copy and its TEGroupedMLP moves them to the host;
    ours keeps them on the device (and its bags need no bincount)."""
    from ps_bridge.tools.bench.catalog import FAMILIES, MODEL_SHAPES
    from ps_bridge.tools.bench.moe_layer import host_syncs, host_waits
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.models.token_permutation import use_megatron_permutation
    from ps_bridge.tools.runtime import load_model_from_hf_config

    shape = MODEL_SHAPES["tiny-qwen3.5-moe"]
    loaded = load_model_from_hf_config(FAMILIES[shape.family](shape.dims, 1), PrefixSharingConfig(enabled=True),
                                       dtype=torch.bfloat16)
    layer = loaded.model.decoder.layers[0].mlp
    layer.train()
    hidden = int(loaded.provider.hidden_size)
    x = torch.randn(300, 1, hidden, device=loaded.device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    _layer_step(layer, x, grad)  # first call: compiles, decides the chunk sort, caches the spans
    assert not host_waits(layer, x, grad), host_syncs(layer, x, grad)
    use_megatron_permutation(layer.token_dispatcher)  # the check can fail: megatron's dispatcher waits
    assert host_waits(layer, x, grad)
