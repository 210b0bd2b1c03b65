"""MoE router statistics other than the load-balancing loss under prefix sharing (Qwen3.5-MoE, CPU fp32).

The z-loss and the aux-loss-free expert-bias token counts are weighted like the aux loss (a prompt
token by its group size): the shared run gives the unshared run's z-loss value and gradients, and
the same per-expert token counts and bias update (`finish_router_statistics`, megatron's
`finalize_model_grads` step, which `parallel.finish_gradients` runs). Token dropping is refused.
"""

import pytest
import torch

import ps_bridge.models.moe as moe_module
from qwen35_helpers import layout_for, load_tiny, param_grads, samples_for
from ps_bridge.models.moe import PrefixSharedTopKRouter, finish_router_statistics
from ps_bridge.models.packed_seq import PrefixSharedPackedSeqParams


def _routers(loaded):
    routers = [m for m in loaded.model.modules() if isinstance(m, PrefixSharedTopKRouter)]
    assert len(routers) == 4
    return routers


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    _, loaded, _ = load_tiny("qwen3.5-moe", tmp_path_factory)
    assert all(r.config is loaded.provider for r in _routers(loaded))
    return loaded


@pytest.fixture
def z_loss_only(moe):
    """z-loss on (large, so its gradient is visible), the load-balancing loss off."""
    p = moe.provider
    saved = (p.moe_z_loss_coeff, p.moe_aux_loss_coeff)
    p.moe_z_loss_coeff, p.moe_aux_loss_coeff = 0.5, 0.0
    moe.model.train()
    yield moe
    moe.model.eval()
    p.moe_z_loss_coeff, p.moe_aux_loss_coeff = saved


def z_losses(loaded, samples, share, monkeypatch, weighted=True, pad_multiple=1):
    """The z-loss each router attaches in one training forward pass (ours, or megatron's stock one)."""
    from megatron.core.transformer.moe import router as megatron_router

    from ps_bridge.tools.runtime import forward_logits

    recorded = []
    real = moe_module.MoEAuxLossAutoScaler

    class Recorder:
        @staticmethod
        def apply(x, loss):
            recorded.append(loss.item())
            return real.apply(x, loss)

    monkeypatch.setattr(moe_module, "MoEAuxLossAutoScaler", Recorder)
    monkeypatch.setattr(megatron_router, "MoEAuxLossAutoScaler", Recorder)
    if not weighted:  # megatron's stock z-loss: every packed token counts once
        monkeypatch.setattr(PrefixSharedPackedSeqParams, "moe_token_weights", property(lambda self: None))
    forward_logits(loaded, layout_for(loaded, samples, share, pad_multiple))
    monkeypatch.undo()
    assert len(recorded) == 4
    return recorded


def _worst_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_z_loss_value_shared_equals_unshared_and_megatron(z_loss_only, monkeypatch):
    loaded = z_loss_only
    samples = samples_for(loaded, num_prompts=2, n=4)
    shared = z_losses(loaded, samples, True, monkeypatch, pad_multiple=4)
    unshared = z_losses(loaded, samples, False, monkeypatch, pad_multiple=4)
    assert _worst_rel(shared, unshared) <= 1e-6, (shared, unshared)
    stock_unshared = z_losses(loaded, samples, False, monkeypatch, weighted=False)  # no padding
    assert _worst_rel(unshared, stock_unshared) <= 1e-6, (unshared, stock_unshared)
    stock_shared = z_losses(loaded, samples, True, monkeypatch, weighted=False)  # what weighting fixes
    assert _worst_rel(stock_shared, unshared) > 1e-4


def test_z_loss_gradients_shared_equal_unshared(z_loss_only):
    loaded = z_loss_only
    samples = samples_for(loaded, num_prompts=2, n=3)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s.response), generator=gen) for s in samples]
    g_shared = param_grads(loaded, samples, True, weights, pad_multiple=2)
    g_unshared = param_grads(loaded, samples, False, weights, pad_multiple=2)
    worst = max(((g_shared[n] - g_unshared[n]).abs().max() / g_unshared[n].abs().max().clamp(min=1e-12)).item()
                for n in g_shared)
    assert worst <= 1e-5, worst
    loaded.provider.moe_z_loss_coeff = None  # the z-loss does reach the router weights
    g_without = param_grads(loaded, samples, True, weights, pad_multiple=2)
    router = [n for n in g_shared if n.endswith("router.weight")]
    assert max((g_shared[n] - g_without[n]).abs().max().item() for n in router) > 1e-4


@pytest.fixture(scope="module")
def moe_with_expert_bias(tmp_path_factory):
    """The tiny Qwen3.5-MoE with megatron's expert bias switched on after loading (Megatron-Bridge's
    Qwen3.5 mapping has no HF tensor for `router.expert_bias`, so a model built with it cannot load)."""
    _, loaded, _ = load_tiny("qwen3.5-moe", tmp_path_factory)
    loaded.provider.moe_router_enable_expert_bias = True  # the config finalize_model_grads reads
    for r in _routers(loaded):
        r.enable_expert_bias = True
        del r.local_tokens_per_expert, r.expert_bias  # None attributes when built without it
        r.register_buffer("local_tokens_per_expert", torch.zeros(r.config.num_moe_experts), persistent=False)
        r.register_buffer("expert_bias", torch.zeros(r.config.num_moe_experts))
    loaded.model.train()
    return loaded


def _bias_step(loaded, samples, share, weights, start_bias):
    """One training step's expert-bias counts, the bias after the update, and the gradients."""
    routers = _routers(loaded)
    for r, b in zip(routers, start_bias):
        r.expert_bias.copy_(b)
        r.local_tokens_per_expert.zero_()
    grads = param_grads(loaded, samples, share, weights, pad_multiple=2)
    counts = [r.local_tokens_per_expert.clone() for r in routers]
    finish_router_statistics(loaded.model, loaded.provider)
    assert all(r.local_tokens_per_expert.abs().max() == 0 for r in routers)  # reset for the next step
    return counts, [r.expert_bias.clone() for r in routers], grads


def test_expert_bias_counts_update_and_gradients_shared_equal_unshared(moe_with_expert_bias):
    loaded = moe_with_expert_bias
    samples = samples_for(loaded, num_prompts=2, n=4)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(s.response), generator=gen) for s in samples]
    start = [0.01 * torch.randn(loaded.provider.num_moe_experts, generator=gen) for _ in range(4)]
    c_sh, b_sh, g_sh = _bias_step(loaded, samples, True, weights, start)
    c_un, b_un, g_un = _bias_step(loaded, samples, False, weights, start)
    unshared_tokens = sum(len(s.prompt) + len(s.response) for s in samples)
    for a, b in zip(c_sh, c_un):
        assert torch.equal(a, b), (a, b)
        assert a.sum().item() == unshared_tokens * loaded.provider.moe_router_topk
    for a, b, s in zip(b_sh, b_un, start):
        assert torch.equal(a, b)
        assert (a - s).abs().max() > 0  # the update ran
    worst = max(((g_sh[n] - g_un[n]).abs().max() / g_un[n].abs().max().clamp(min=1e-12)).item() for n in g_sh)
    assert worst <= 1e-5, worst


def test_token_dropping_refused_by_name(moe):
    from ps_bridge.models.moe import check_moe_settings

    moe.provider.moe_expert_capacity_factor = 1.0
    try:
        with pytest.raises(ValueError, match="moe_expert_capacity_factor"):
            check_moe_settings(moe.provider)
    finally:
        moe.provider.moe_expert_capacity_factor = None
    check_moe_settings(moe.provider)
