"""Qwen2.5 through our provider: Megatron == HF, shared == unshared (log-probs and gradients),
export round trip, provider registry and config errors."""

import pytest
import torch

from ps_bridge.tools.compare import compare, max_abs_diff, max_relative_grad_diff, run_logprob_loss
from ps_bridge.layout import Sample
from ps_bridge.tools.runtime import forward_logits, make_layout
from ps_bridge.tools.tiny_checkpoints import grpo_like_samples, hf_sample_logprobs

pytestmark = pytest.mark.core  # also run on the oldest tested stack


def test_provider_and_model_classes(qwen2_loaded):
    from ps_bridge.models.attention import PrefixSharedCoreAttention
    from ps_bridge.models.gpt_model import PrefixSharedGPTModel
    from ps_bridge.providers.qwen2 import PrefixSharedQwen2Provider

    assert isinstance(qwen2_loaded.provider, PrefixSharedQwen2Provider)
    assert isinstance(qwen2_loaded.model, PrefixSharedGPTModel)
    cores = [m for m in qwen2_loaded.model.modules() if isinstance(m, PrefixSharedCoreAttention)]
    assert len(cores) == 2


def test_megatron_logits_equal_hf_logits(qwen2_checkpoint, qwen2_loaded):
    _, hf_model = qwen2_checkpoint
    samples = [Sample([3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]), Sample([2, 7, 1, 8], [2, 8, 1, 8, 2])]
    layout = make_layout(samples, qwen2_loaded, share=False)
    with torch.no_grad():
        logits = forward_logits(qwen2_loaded, layout)
        for i, s in enumerate(samples):
            ids = torch.tensor([s.prompt + s.response])
            ref = hf_model(ids).logits[0]
            a, b = int(layout.row_offsets[i]), int(layout.row_offsets[i + 1])
            got = logits[layout.row_source[a:b]]
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_shared_logprobs_and_gradients_equal_unshared_and_hf(qwen2_checkpoint, qwen2_loaded):
    _, hf_model = qwen2_checkpoint
    samples = grpo_like_samples(256, num_prompts=3, n=4, seed=3)
    r = compare(qwen2_loaded, samples, hf_model)
    assert r["tokens_shared"] < r["tokens_unshared"]
    assert r["max_logprob_diff_shared_vs_hf"] <= 1e-5
    assert r["max_logprob_diff_unshared_vs_hf"] <= 1e-5
    assert r["max_logprob_diff_shared_vs_unshared"] <= 1e-5
    assert r["max_rel_grad_diff_shared_vs_unshared"] <= 1e-5


def test_gradients_equal_hf_gradients(qwen2_checkpoint, qwen2_loaded):
    """Shared-run gradients of the embedding and LM head equal HF's for the same loss."""
    from ps_bridge.tools.compare import loss_weights

    _, hf_model = qwen2_checkpoint
    samples = grpo_like_samples(256, num_prompts=2, n=3, seed=5)
    shared = run_logprob_loss(qwen2_loaded, samples, share=True)
    hf_model.zero_grad(set_to_none=True)
    lps = hf_sample_logprobs(hf_model, samples)
    sum((w * lp).sum() for w, lp in zip(loss_weights(samples), lps)).backward()
    pairs = {
        "embedding.word_embeddings.weight": hf_model.model.embed_tokens.weight.grad,
        "output_layer.weight": hf_model.lm_head.weight.grad,
        "decoder.final_layernorm.weight": hf_model.model.norm.weight.grad,
        "decoder.layers.0.mlp.linear_fc2.weight": hf_model.model.layers[0].mlp.down_proj.weight.grad,
    }
    for name, ref in pairs.items():
        got = shared.grads[name]
        assert float((got - ref).norm() / ref.norm()) <= 1e-5, name
    hf_model.zero_grad(set_to_none=True)


def test_every_gradient_equals_hf(qwen2_checkpoint, qwen2_loaded):
    """All parameters, matched by HF name through the bridge's export."""
    from ps_bridge.tools.compare import hf_gradient_difference

    _, hf_model = qwen2_checkpoint
    r = hf_gradient_difference(qwen2_loaded, hf_model, grpo_like_samples(256, num_prompts=2, n=3, seed=5))
    assert r["parameters_compared"] == len(list(hf_model.parameters()))
    assert r["max_rel_grad_diff_vs_hf"] <= 1e-5, r


def test_wrong_response_positions_are_detected(qwen2_loaded, monkeypatch):
    """Negative control: if responses restarted RoPE at 0, shared would differ from unshared."""
    import ps_bridge.layout as layout_mod

    samples = grpo_like_samples(256, num_prompts=2, n=3, seed=1)
    good = run_logprob_loss(qwen2_loaded, samples, share=True, backward=False)
    original = layout_mod.build_layout

    def restart_positions(*args, **kwargs):
        lay = original(*args, **kwargs)
        lay.positions = torch.where(lay.is_prompt, lay.positions, lay.positions - lay.positions.min())
        resp = ~lay.is_prompt
        for s in range(lay.num_prompt_segments, lay.num_segments):
            seg = lay.segment_ids == s
            lay.positions[seg] = torch.arange(int(seg.sum()))
        assert resp.any()
        return lay

    monkeypatch.setattr("ps_bridge.prepare.build_layout", restart_positions)
    bad = run_logprob_loss(qwen2_loaded, samples, share=True, backward=False)
    assert max_abs_diff(good.logprobs, bad.logprobs) > 1e-3


def test_group_split_across_micro_batches_is_exact(qwen2_loaded):
    samples = grpo_like_samples(256, num_prompts=2, n=4, seed=7, shuffle=False)
    whole = run_logprob_loss(qwen2_loaded, samples, share=False, backward=False)
    a = run_logprob_loss(qwen2_loaded, samples[:5], share=True, backward=False)
    b = run_logprob_loss(qwen2_loaded, samples[5:], share=True, backward=False)
    assert max_abs_diff(a.logprobs + b.logprobs, whole.logprobs) <= 1e-5


def test_export_round_trip_is_exact(qwen2_checkpoint, qwen2_loaded):
    _, hf_model = qwen2_checkpoint
    ref = hf_model.state_dict()
    exported = dict(qwen2_loaded.bridge.export_hf_weights([qwen2_loaded.model], cpu=True, show_progress=False))
    assert set(exported) == {k for k in ref if not k.endswith("rotary_emb.inv_freq")}
    for name, tensor in exported.items():
        assert torch.equal(tensor.to(ref[name].dtype), ref[name]), name


def test_load_hf_weights_restores_perturbed_model(qwen2_checkpoint, qwen2_loaded):
    path, _ = qwen2_checkpoint
    samples = grpo_like_samples(256, num_prompts=1, n=2, seed=2)
    before = run_logprob_loss(qwen2_loaded, samples, share=True, backward=False)
    with torch.no_grad():
        for p in qwen2_loaded.model.parameters():
            p.add_(0.01)
    qwen2_loaded.bridge.load_hf_weights([qwen2_loaded.model], path)
    after = run_logprob_loss(qwen2_loaded, samples, share=True, backward=False)
    assert max_abs_diff(before.logprobs, after.logprobs) == 0.0


def test_registry_and_config_errors(monkeypatch):
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.providers.registry import provider_names, resolve_provider

    assert "qwen2.5" in provider_names()
    assert resolve_provider(None, ["Qwen2ForCausalLM"]).name == "qwen2.5"
    with pytest.raises(ValueError, match="unsupported architecture GPTNeoXForCausalLM"):
        resolve_provider(None, ["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match="valid providers"):
        PrefixSharingConfig(provider="qwen9")
    with pytest.raises(ValueError, match="valid backends"):
        PrefixSharingConfig(backend="cuda_magic")
    monkeypatch.setenv("ENABLE_PREFIX_SHARING", "1")
    monkeypatch.setenv("PS_BRIDGE_BACKEND", "torch_ref")
    cfg = PrefixSharingConfig.from_env()
    assert cfg.enabled and cfg.backend == "torch_ref"
    monkeypatch.setenv("ENABLE_PREFIX_SHARING", "maybe")
    with pytest.raises(ValueError, match="ENABLE_PREFIX_SHARING"):
        PrefixSharingConfig.from_env()


def test_dynamic_context_and_virtual_pipeline_parallel_are_refused():
    """The one parallel-settings check, read from a megatron/verl config object, and applied by
    our providers when the model is built: a fixed CP size is accepted, dynamic CP and VPP are not."""
    from types import SimpleNamespace

    from ps_bridge.parallel.settings import ParallelSettings
    from ps_bridge.providers.base import prepare_for_prefix_sharing

    def settings(**kw):
        return ParallelSettings.from_config(SimpleNamespace(**kw))

    settings(context_parallel_size=2).check_supported()
    with pytest.raises(ValueError, match="dynamic_context_parallel"):
        settings(dynamic_context_parallel=True).check_supported()
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=2"):
        settings(virtual_pipeline_model_parallel_size=2).check_supported()
    settings(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2).check_supported()
    with pytest.raises(ValueError, match="dynamic_context_parallel"):
        prepare_for_prefix_sharing(SimpleNamespace(context_parallel_size=2, dynamic_context_parallel=True))


def test_float32_reference_model_has_exactly_the_bf16_weights(qwen2_checkpoint):
    """The bench's and the GPU tests' float32 twin: the bf16 weights upcast bit for bit, torch_ref
    kernels, no sharing; and it really runs in float32 (its log-probs differ from the bf16 run's)."""
    from transformers import AutoConfig

    from ps_bridge.tools.compare import run_logprob_loss
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.runtime import float32_reference_model, load_model
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

    path, _ = qwen2_checkpoint
    bf16 = load_model(path, PrefixSharingConfig(enabled=True, backend="torch_ref"), dtype=torch.bfloat16)
    twin = float32_reference_model(bf16, AutoConfig.from_pretrained(path))
    assert twin.dtype == torch.float32 and twin.config.backend == "torch_ref" and not twin.config.enabled
    source = dict(bf16.model.named_parameters())
    for name, p in twin.model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, source[name].float()), name
    samples = grpo_like_samples(bf16.vocab_size, num_prompts=2, n=2)
    lp_twin = run_logprob_loss(twin, samples, share=False, backward=False).logprobs
    lp_bf16 = run_logprob_loss(bf16, samples, share=False, backward=False).logprobs
    assert max(float((a - b.float()).abs().max()) for a, b in zip(lp_twin, lp_bf16)) > 1e-4
