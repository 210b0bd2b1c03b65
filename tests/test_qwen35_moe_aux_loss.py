"""MoE load-balancing loss under prefix sharing (Qwen3.5-MoE: global aux loss; Qwen3 MoE: per-micro-batch
aux loss, a dense layer among the MoE layers; CPU fp32).

Prompt tokens are weighted by their group size, so the shared run reproduces the unshared run's
aux loss values and all parameter gradients (log-prob loss + aux loss); the unshared run reproduces
megatron's own aux loss when the pack has no padding. Without the weights the shared value differs.
"""

import pytest
import torch

from qwen35_helpers import load_tiny, param_grads, samples_for
from ps_bridge.models.moe import PrefixSharedTopKRouter
from ps_bridge.models.packed_seq import PrefixSharedPackedSeqParams


# architecture: (the load-balancing type its bridge sets, MoE layers of the tiny checkpoint)
CASES = {"qwen3.5-moe": ("global_aux_loss", 4), "qwen3.5-moe-vl": ("global_aux_loss", 4), "qwen3-moe": ("aux_loss", 3)}


@pytest.fixture(scope="module", params=sorted(CASES))
def moe(request, tmp_path_factory):
    _, loaded, _ = load_tiny(request.param, tmp_path_factory)
    balancing, moe_layers = CASES[request.param]
    assert loaded.provider.moe_router_load_balancing_type == balancing
    loaded.provider.moe_aux_loss_coeff = 0.5  # large, so the aux gradient is visible next to the log-prob one
    routers = [m for m in loaded.model.modules() if isinstance(m, PrefixSharedTopKRouter)]
    assert len(routers) == moe_layers
    loaded.model.train()
    yield loaded, routers
    loaded.model.eval()


def aux_losses(loaded, routers, samples, share, pad_multiple=1, weighted=True, monkeypatch=None):
    """Per-layer global load-balancing loss values of one forward pass."""
    from ps_bridge.tools.runtime import forward_logits
    from qwen35_helpers import layout_for

    recorded = {}
    original = PrefixSharedTopKRouter.attach_and_log_load_balancing_loss

    def record(self, activation, coeff, aux_loss, name, *args, **kwargs):
        recorded[self.layer_number] = (aux_loss / coeff).item()
        return original(self, activation, coeff, aux_loss, name, *args, **kwargs)

    monkeypatch.setattr(PrefixSharedTopKRouter, "attach_and_log_load_balancing_loss", record)
    if not weighted:  # no weights: megatron's stock statistics, every packed token counts once
        monkeypatch.setattr(PrefixSharedPackedSeqParams, "moe_token_weights", property(lambda self: None))
    for r in routers:
        r.reset_global_aux_loss_tracker()
    layout = layout_for(loaded, samples, share, pad_multiple)
    forward_logits(loaded, layout)
    monkeypatch.undo()
    return [recorded[k] for k in sorted(recorded)]


def test_shared_aux_loss_equals_unshared(moe, monkeypatch):
    loaded, routers = moe
    samples = samples_for(loaded, num_prompts=2, n=4)
    shared = aux_losses(loaded, routers, samples, True, pad_multiple=4, monkeypatch=monkeypatch)
    unshared = aux_losses(loaded, routers, samples, False, pad_multiple=4, monkeypatch=monkeypatch)
    assert len(shared) == len(routers)
    assert max(abs(a - b) / abs(b) for a, b in zip(shared, unshared)) <= 1e-6, (shared, unshared)


def test_unshared_weighted_equals_megatron_stock_without_padding(moe, monkeypatch):
    loaded, routers = moe
    samples = samples_for(loaded, num_prompts=2, n=4)
    ours = aux_losses(loaded, routers, samples, False, monkeypatch=monkeypatch)
    stock = aux_losses(loaded, routers, samples, False, weighted=False, monkeypatch=monkeypatch)
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, stock)) <= 1e-6, (ours, stock)


def test_unweighted_shared_aux_loss_differs(moe, monkeypatch):
    """What differs without the weights: each prompt token counted once instead of n times."""
    loaded, routers = moe
    samples = samples_for(loaded, num_prompts=2, n=4)
    stock_shared = aux_losses(loaded, routers, samples, True, weighted=False, monkeypatch=monkeypatch)
    unshared = aux_losses(loaded, routers, samples, False, monkeypatch=monkeypatch)
    assert max(abs(a - b) / abs(b) for a, b in zip(stock_shared, unshared)) > 1e-4


def test_gradients_with_aux_loss_shared_equal_unshared(moe):
    loaded, routers = moe
    samples = samples_for(loaded, num_prompts=2, n=3)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s.response), generator=gen) for s in samples]
    for r in routers:
        r.reset_global_aux_loss_tracker()
    g_shared = param_grads(loaded, samples, True, weights, pad_multiple=2)
    for r in routers:
        r.reset_global_aux_loss_tracker()
    g_unshared = param_grads(loaded, samples, False, weights, pad_multiple=2)
    router_grads = [n for n in g_shared if n.endswith("router.weight")]
    assert router_grads
    worst = max(((g_shared[n] - g_unshared[n]).abs().max() / g_unshared[n].abs().max().clamp(min=1e-12)).item()
                for n in g_shared)
    assert worst <= 1e-5, worst
