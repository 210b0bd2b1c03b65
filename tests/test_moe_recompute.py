"""MoE activation recompute with prefix sharing (Qwen3.5-MoE, CPU fp32): the recomputed router reads
its own micro-batch's token weights.

With megatron's MoE recompute (`recompute_granularity="selective"`, `recompute_modules=["moe"]`)
the MoE layer's forward runs without gradients and is recomputed in the backward pass; the router's
load-balancing loss is attached there. Under pipeline parallelism (1F1B) a stage runs the forward of
micro-batch k+1 before the backward of micro-batch k. That order is reproduced here on one rank:
forward A, forward B, backward A, backward B, with A and B of the same packed length but different
groupings (so different token weights). When the weights stayed on the router after a call, A's
recompute read B's weights (equal lengths: no error) and its aux loss and gradients were wrong.
The aux loss values and every gradient must equal the unshared run (no recompute, one micro-batch
after the other).
"""

import pytest
import torch

from parallel_cases import aux_by_micro_batch, moe_recompute_on_build, recorded_aux_losses
from ps_bridge.layout import Sample
from ps_bridge.models.moe import PrefixSharedMoELayer, PrefixSharedTopKRouter
from ps_bridge.models.packed_seq import moe_token_weights
from qwen35_helpers import layout_for, load_tiny, per_sample_response_logprobs


def _micro_batches():
    """A: one prompt of 8 tokens, 4 responses of 3 (prompt weight 4); B: two prompts of 4, two
    responses of 3 each (prompt weight 2). Both pack to 20 tokens shared."""
    def ids(start, n):
        return [(start + 7 * i) % 240 + 1 for i in range(n)]

    a = [Sample(ids(1, 8), ids(100 + 10 * r, 3)) for r in range(4)]
    b = [Sample(ids(50 + 20 * g, 4), ids(150 + 10 * (2 * g + r), 3)) for g in range(2) for r in range(2)]
    return a, b


@pytest.fixture(scope="module")
def recomputing(tmp_path_factory):
    """The tiny Qwen3.5-MoE built with megatron's MoE recompute switched on in its config."""
    with moe_recompute_on_build():
        _, loaded, _ = load_tiny("qwen3.5-moe", tmp_path_factory)
    layers = [m for m in loaded.model.modules() if isinstance(m, PrefixSharedMoELayer)]
    assert len(layers) == 4 and all(m.recompute_with_token_weights for m in layers)
    assert not any(m.moe_layer_recompute for m in layers)  # megatron's own checkpoint is off: ours runs
    loaded.provider.moe_aux_loss_coeff = 0.5  # large, so the aux gradient is visible next to the log-prob one
    loaded.model.train()
    return loaded


def _run(loaded, micro_batches, share, interleaved):
    """Aux loss values per (micro-batch, layer) and all gradients of sum_mb <w, logp>."""
    for m in loaded.model.modules():
        if isinstance(m, PrefixSharedTopKRouter):
            m.reset_global_aux_loss_tracker()
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(len(s.response), generator=gen) for s in mb] for mb in micro_batches]

    def loss(k):
        lps = per_sample_response_logprobs(loaded, micro_batches[k], share)
        return sum((lp * w).sum() for lp, w in zip(lps, weights[k])), lps

    loaded.model.zero_grad(set_to_none=True)
    logprobs = []
    with recorded_aux_losses() as records:
        if interleaved:  # a pipeline stage's 1F1B order: forward A, forward B, backward A, backward B
            first, lp_a = loss(0)
            second, lp_b = loss(1)
            first.backward()
            second.backward()
            logprobs = [lp_a, lp_b]
        else:
            for k in range(len(micro_batches)):
                value, lps = loss(k)
                value.backward()
                logprobs.append(lps)
    grads = {n: p.grad.detach().clone() for n, p in loaded.model.named_parameters() if p.grad is not None}
    loaded.model.zero_grad(set_to_none=True)
    return aux_by_micro_batch(records), grads, [[lp.detach() for lp in mb] for mb in logprobs]


def test_recomputed_moe_reads_its_own_micro_batch_weights(recomputing):
    loaded = recomputing
    a, b = _micro_batches()
    wa = moe_token_weights(layout_for(loaded, a, True))
    wb = moe_token_weights(layout_for(loaded, b, True))
    assert wa.shape == wb.shape and not torch.equal(wa, wb)  # equal packed lengths, other weights

    aux, grads, logprobs = _run(loaded, [a, b], share=True, interleaved=True)
    ref_aux, ref_grads, ref_logprobs = _run(loaded, [a, b], share=False, interleaved=False)

    assert len(aux) == len(ref_aux) == 8 and set(aux) == set(ref_aux)
    worst_aux = max(abs(aux[k] - ref_aux[k]) / abs(ref_aux[k]) for k in ref_aux)
    worst_lp = max((x - y).abs().max().item() for mb, ref in zip(logprobs, ref_logprobs) for x, y in zip(mb, ref))
    assert set(grads) == set(ref_grads) and any(n.endswith("router.weight") for n in grads)
    worst_grad = max(((grads[n] - r).norm() / r.norm()).item() for n, r in ref_grads.items())
    print(f"recompute, 1F1B order: aux loss rel {worst_aux:.2e}, |logp| {worst_lp:.2e}, grad rel {worst_grad:.2e}")
    assert worst_aux <= 1e-5, (aux, ref_aux)
    assert worst_lp <= 1e-5
    assert worst_grad <= 1e-5
    for m in loaded.model.modules():  # nothing stays on a router between calls
        if isinstance(m, PrefixSharedTopKRouter):
            assert m.token_weights is None and m.pad_rows == 0
