"""Prefix trees through the models (CPU fp32): log-probs equal Hugging Face's and the unshared
run's, every parameter gradient equals the unshared run's (Qwen2.5; Qwen3.5 dense and MoE, whose
load-balancing loss and z-loss weight each token by the samples passing through it).

The batches are random trees (tree_cases: a system prompt shared across prompts, depth up to 4,
nodes of 1-3 tokens between long ones, samples that are prefixes of others, identical samples),
shared with `share="tree"` at threshold 0 (every common token shared)."""

from contextlib import contextmanager

import pytest
import torch

from qwen35_helpers import load_tiny, max_abs, param_grads, per_sample_response_logprobs
from test_qwen35_moe_router_stats import _bias_step, moe_with_expert_bias  # noqa: F401 (a fixture)
from tree_cases import tree_samples
from ps_bridge.compare import hf_logprobs, max_abs_diff, max_relative_grad_diff, run_logprob_loss
from ps_bridge.layout import build_layout
from ps_bridge.runtime import make_layout


@contextmanager
def tree_config(loaded, backend="torch_ref", pad_multiple=None):
    config = loaded.config
    saved = (config.tree, config.tree_min_shared, config.backend, config.pad_multiple)
    config.tree, config.tree_min_shared, config.backend, config.pad_multiple = True, 0, backend, pad_multiple
    try:
        yield
    finally:
        config.tree, config.tree_min_shared, config.backend, config.pad_multiple = saved


@pytest.mark.parametrize("seed, pad_multiple", [(0, None), (2, 4)])
def test_qwen2_tree_logprobs_and_gradients(qwen2_checkpoint, qwen2_loaded, seed, pad_multiple):
    _, hf_model = qwen2_checkpoint
    samples = tree_samples(seed)
    assert build_layout(samples, share="tree", min_shared=0).tree_depth >= 2
    with tree_config(qwen2_loaded, pad_multiple=pad_multiple):
        assert make_layout(samples, qwen2_loaded).tree_depth >= 2  # what the run below packs
        shared = run_logprob_loss(qwen2_loaded, samples, share=True)
    unshared = run_logprob_loss(qwen2_loaded, samples, share=False)
    ref = hf_logprobs(hf_model, samples)
    assert max_abs_diff(shared.logprobs, ref) <= 2e-5
    assert max_abs_diff(shared.logprobs, unshared.logprobs) <= 1e-5
    assert max_relative_grad_diff(shared.grads, unshared.grads) <= 1e-5


def test_qwen2_tree_flex_logprobs(qwen2_checkpoint, qwen2_loaded):
    """flex on the CPU runs forward only (FlexAttention has no CPU backward)."""
    _, hf_model = qwen2_checkpoint
    samples = tree_samples(1)
    with tree_config(qwen2_loaded, backend="flex"):
        assert make_layout(samples, qwen2_loaded).tree_depth >= 2
        shared = run_logprob_loss(qwen2_loaded, samples, share=True, backward=False)
    assert max_abs_diff(shared.logprobs, hf_logprobs(hf_model, samples)) <= 2e-5


def test_qwen2_tree_split_across_micro_batches(qwen2_checkpoint, qwen2_loaded):
    """Samples sharing a prefix split across two micro-batches: each part is its own tree, still exact."""
    _, hf_model = qwen2_checkpoint
    samples = tree_samples(5)
    half = len(samples) // 2
    with tree_config(qwen2_loaded):
        parts = [run_logprob_loss(qwen2_loaded, part, share=True, backward=False).logprobs
                 for part in (samples[:half], samples[half:])]
    assert max_abs_diff(parts[0] + parts[1], hf_logprobs(hf_model, samples)) <= 2e-5


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3.5-moe"])
def qwen35(request, tmp_path_factory):
    hf, loaded, _ = load_tiny(request.param, tmp_path_factory)
    return request.param, hf, loaded


def test_qwen35_tree_logprobs_equal_hf_and_unshared(qwen35):
    name, hf, loaded = qwen35
    loaded.model.eval()
    samples = tree_samples(3)
    assert build_layout(samples, share="tree", min_shared=0).tree_depth >= 2
    with torch.no_grad():
        shared = per_sample_response_logprobs(loaded, samples, share="tree", pad_multiple=2)
        unshared = per_sample_response_logprobs(loaded, samples, share=False)
        ref = hf_logprobs(hf, samples)
    assert max_abs(shared, ref) <= 2e-5, (name, max_abs(shared, ref))
    assert max_abs(shared, unshared) <= 1e-5, (name, max_abs(shared, unshared))


def test_qwen35_tree_gradients_equal_unshared(qwen35):
    """Training mode: for the MoE model the load-balancing loss and the z-loss (large coefficients,
    so their gradients are visible) are part of the gradients compared."""
    name, _, loaded = qwen35
    provider = loaded.provider
    moe = "moe" in name
    saved = (getattr(provider, "moe_aux_loss_coeff", None), getattr(provider, "moe_z_loss_coeff", None))
    if moe:
        provider.moe_aux_loss_coeff, provider.moe_z_loss_coeff = 0.5, 0.5
    loaded.model.train()
    try:
        samples = tree_samples(4)
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(len(s.response), generator=gen) for s in samples]
        g_tree = param_grads(loaded, samples, "tree", weights, pad_multiple=2)
        g_flat = param_grads(loaded, samples, False, weights)
    finally:
        loaded.model.eval()
        if moe:
            provider.moe_aux_loss_coeff, provider.moe_z_loss_coeff = saved
    assert g_tree.keys() == g_flat.keys() and any("A_log" in n for n in g_tree)
    worst = max(((g_tree[n] - g_flat[n]).norm() / g_flat[n].norm().clamp(min=1e-12)).item() for n in g_tree)
    assert worst <= 1e-5, (name, worst)


def test_qwen35_moe_tree_expert_bias_counts_equal_unshared(moe_with_expert_bias):
    """The aux-loss-free expert bias: per-expert token counts, the bias update and the gradients of a
    tree run equal the unshared run's (each position counted once per sample through it)."""
    loaded = moe_with_expert_bias
    samples = tree_samples(4)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(s.response), generator=gen) for s in samples]
    start = [0.01 * torch.randn(loaded.provider.num_moe_experts, generator=gen) for _ in range(4)]
    c_tree, b_tree, g_tree = _bias_step(loaded, samples, "tree", weights, start)
    c_flat, b_flat, g_flat = _bias_step(loaded, samples, False, weights, start)
    unshared_tokens = sum(len(s.prompt) + len(s.response) for s in samples)
    for a, b in zip(c_tree, c_flat):
        assert torch.equal(a, b) and a.sum().item() == unshared_tokens * loaded.provider.moe_router_topk
    for a, b in zip(b_tree, b_flat):
        assert torch.equal(a, b)
    worst = max(((g_tree[n] - g_flat[n]).abs().max() / g_flat[n].abs().max().clamp(min=1e-12)).item() for n in g_tree)
    assert worst <= 1e-5, worst
