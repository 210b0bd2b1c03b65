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
from ps_bridge.tools.compare import hf_logprobs, max_abs_diff, max_relative_grad_diff, run_logprob_loss
from ps_bridge.layout import Sample, build_layout
from ps_bridge.tools.runtime import make_layout


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
    """Samples sharing a prefix split across two micro-batches: each part is its own tree (its shared
    prefix computed in both); through megatron's schedule over both micro-batches the log-probs equal
    HF's and the unshared run's, and every gradient the unshared run's."""
    from ps_bridge.tools.compare import loss_weights, max_relative_grad_diff
    from ps_bridge.tools.schedule import logprob_pass

    _, hf_model = qwen2_checkpoint
    samples = tree_samples(1)  # 24 samples, depth 4; its halves are trees of depth 4 and 3
    half = len(samples) // 2
    parts = [samples[:half], samples[half:]]
    assert all(build_layout(part, share="tree", min_shared=0).tree_depth >= 2 for part in parts)
    weights = [loss_weights(part, seed=i) for i, part in enumerate(parts)]
    model = qwen2_loaded.model

    def run(share):
        model.zero_grad(set_to_none=True)
        logprobs = logprob_pass(qwen2_loaded, parts, share=share, loss_weights=weights)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return logprobs[0] + logprobs[1], grads

    with tree_config(qwen2_loaded):
        shared, g_shared = run(True)
    unshared, g_unshared = run(False)
    assert max_abs_diff(shared, hf_logprobs(hf_model, samples)) <= 2e-5
    assert max_abs_diff(shared, unshared) <= 1e-5
    assert g_shared.keys() == g_unshared.keys() and max_relative_grad_diff(g_shared, g_unshared) <= 1e-5


def test_qwen2_long_tree_no_farther_from_hf_than_unshared(qwen2_checkpoint, qwen2_loaded):
    """Long sequences (a system prompt of 200 tokens under 2 prompts of 3 responses, a 3-turn chain;
    up to about 450 tokens a sample): the tree's log-probs are no farther from HF's than the unshared
    run's (or within 2e-5), and within 1e-5 of the unshared run's."""
    from ps_bridge.tools.tiny_checkpoints import system_prompt_samples

    _, hf_model = qwen2_checkpoint
    samples = system_prompt_samples(qwen2_loaded.vocab_size, system_len=200, num_prompts=2, n=3, prompt_len=(32, 48),
                                    response_len=(32, 64), turns=3, observation_len=16, seed=5)
    assert max(len(s.prompt) + len(s.response) for s in samples) <= 512  # the tiny checkpoint's positions
    assert build_layout(samples, share="tree", min_shared=0).tree_depth >= 2
    with tree_config(qwen2_loaded):
        shared = run_logprob_loss(qwen2_loaded, samples, share=True, backward=False).logprobs
    unshared = run_logprob_loss(qwen2_loaded, samples, share=False, backward=False).logprobs
    with torch.no_grad():
        ref = hf_logprobs(hf_model, samples)
    print(f"long tree: |shared - HF| {max_abs_diff(shared, ref):.2e}, |unshared - HF| {max_abs_diff(unshared, ref):.2e}")
    assert max_abs_diff(shared, ref) <= max(2e-5, max_abs_diff(unshared, ref))
    assert max_abs_diff(shared, unshared) <= 1e-5


def check_default_threshold(hf, loaded, moe: bool) -> None:
    """At the default threshold (`DEFAULT_MIN_SHARED`; `tree_min_shared=None`): a system prompt longer
    than it shared by every prompt, and a multi-turn chain; the shared runs shorter than it are not
    shared, the tree is still deeper than one level, and the log-probs equal HF's and the unshared
    run's, every gradient the unshared run's (MoE: load-balancing loss and z-loss on)."""
    from ps_bridge.tools.compare import max_relative_grad_diff
    from ps_bridge.layout import DEFAULT_MIN_SHARED
    from ps_bridge.tools.tiny_checkpoints import system_prompt_samples

    # below the tiny VL checkpoints' special ids (250..253); prompts after the system prompt at least
    # as long as the threshold (kept as nodes), and two samples whose common run of 5 tokens is not
    samples = system_prompt_samples(min(loaded.vocab_size, 248), system_len=DEFAULT_MIN_SHARED + 4, num_prompts=3,
                                    n=3, prompt_len=(DEFAULT_MIN_SHARED, DEFAULT_MIN_SHARED + 6), seed=4)
    samples += [Sample([1, 2, 3, 4, 5, 6], [7, 8]), Sample([1, 2, 3, 4, 5, 9], [10])]
    default, everything = build_layout(samples, share="tree"), build_layout(samples, share="tree", min_shared=0)
    assert default.tree_depth >= 2 and everything.tokens_shared < default.tokens_shared < default.tokens_unshared
    provider = loaded.provider
    saved = (getattr(provider, "moe_aux_loss_coeff", None), getattr(provider, "moe_z_loss_coeff", None))
    if moe:
        provider.moe_aux_loss_coeff, provider.moe_z_loss_coeff = 0.5, 0.5
    loaded.model.train()
    config = loaded.config
    kept = (config.tree, config.tree_min_shared, config.backend)
    config.tree, config.tree_min_shared, config.backend = True, None, "torch_ref"
    def fresh_step():
        """Qwen3.5 MoE's `global_aux_loss` sums the tokens per expert over passes until the training
        loop resets it each step (an earlier test's backward passes would otherwise count): each run
        here is one step of its own."""
        for module in loaded.model.modules():
            if hasattr(module, "reset_global_aux_loss_tracker"):
                module.reset_global_aux_loss_tracker()

    try:
        fresh_step()
        shared = run_logprob_loss(loaded, samples, share=True)
        assert shared.tokens == default.tokens_shared  # the default threshold's tree ran
        fresh_step()
        unshared = run_logprob_loss(loaded, samples, share=False)
    finally:
        config.tree, config.tree_min_shared, config.backend = kept
        loaded.model.eval()
        if moe:
            provider.moe_aux_loss_coeff, provider.moe_z_loss_coeff = saved
    with torch.no_grad():
        ref = hf_logprobs(hf, samples)
    assert max_abs_diff(shared.logprobs, ref) <= 2e-5
    assert max_abs_diff(shared.logprobs, unshared.logprobs) <= 1e-5
    assert max_relative_grad_diff(shared.grads, unshared.grads) <= 1e-5


def test_qwen2_tree_at_the_default_threshold(qwen2_checkpoint, qwen2_loaded):
    check_default_threshold(qwen2_checkpoint[1], qwen2_loaded, moe=False)


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
    diffs = {n: ((g_tree[n] - g_flat[n]).norm() / g_flat[n].norm().clamp(min=1e-12)).item() for n in g_tree}
    worst = max(diffs, key=diffs.get)
    # 2e-5: the GDN gate's dt_bias gradient is a sum over every token with cancellation (norm ~1e-3),
    # whose float32 rounding follows the pack's summation order (a wrong tree is off by far more)
    assert diffs[worst] <= 2e-5, (name, worst, diffs[worst], g_flat[worst].norm().item())


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


def test_qwen35_tree_at_the_default_threshold(qwen35):
    name, hf, loaded = qwen35
    check_default_threshold(hf, loaded, moe="moe" in name)


@pytest.mark.parametrize("arch", [pytest.param("qwen3.5", marks=pytest.mark.slow), "qwen3.5-moe"])
def test_logprobs_cli_on_trees_qwen35(arch, tmp_path):
    """`ps-bridge logprobs --tree` on Qwen3.5 (Gated DeltaNet state forked at every branch; MoE router):
    the log-probs equal HF's (2e-5) and `tokens_shared` is the trie's token count."""
    import json

    from tree_cases import distinct_prefixes
    from ps_bridge.tools.cli import main
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS, hf_sample_logprobs

    hf = TINY_BUILDERS[arch](str(tmp_path / "ckpt"))
    samples = tree_samples(3)
    batch, out = tmp_path / "b.json", tmp_path / "out.json"
    batch.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    assert main(["logprobs", "--hf-path", str(tmp_path / "ckpt"), "--batch", str(batch), "--out", str(out), "--tree",
                 "--tree-min-shared", "0"]) == 0
    got = json.loads(out.read_text())
    assert got["tree"] is True and got["shared_path"] is True and got["tree_depth"] >= 2
    assert got["tokens_shared"] == len(distinct_prefixes(samples))  # the trie's tokens (no padding at TP=1)
    with torch.no_grad():
        refs = hf_sample_logprobs(hf, samples)
    assert max(max(abs(a - b) for a, b in zip(s["logprobs"], ref.tolist())) for s, ref in zip(got["samples"], refs)) <= 2e-5
