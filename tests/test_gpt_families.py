"""Standard-attention GPT families through their registration row (providers/gpt.py): Qwen3 dense,
Qwen3 MoE and Llama 3, on CPU, fp32, one rank.

Tiny random checkpoints with awkward shapes: head_dim 24 with hidden 64 and 4 heads (not hidden /
heads), one KV head (MQA), tied and untied embeddings, odd vocabularies, a dense layer among MoE
layers (`mlp_only_layers`), `decoder_sparse_step` 2, `norm_topk_prob` off, RoPE scaling `llama3` with
positions past its low-frequency wavelength. Prefix-shared log-probs and every gradient equal
Hugging Face's and the unshared run's; trees too; what the path cannot compute is refused by name.
"""

from types import SimpleNamespace

import pytest
import torch

from qwen35_helpers import (
    export_matches_checkpoint, max_abs, max_logit_diff_unshared_vs_hf, param_grads, per_sample_response_logprobs,
)
from tree_cases import tree_samples
from ps_bridge.tools.compare import compare, hf_gradient_difference, hf_logprobs, max_abs_diff, max_relative_grad_diff, run_logprob_loss
from ps_bridge.config import PrefixSharingConfig
from ps_bridge.tools.runtime import load_model
from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS, grpo_like_samples, hf_sample_logprobs

pytestmark = pytest.mark.core  # also run on the oldest tested stack

# case: (registry name, checkpoint overrides)
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3_mqa_tied": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True, vocab_size=253)),
    "qwen3-moe": ("qwen3-moe", {}),
    "qwen3-moe_sparse_step2_unnormed": ("qwen3-moe", dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
                                                          tie_word_embeddings=True)),
    "llama3": ("llama3", {}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory):
    name, overrides = CASES[request.param]
    path = str(tmp_path_factory.mktemp(request.param.replace(".", "_")))
    hf = TINY_BUILDERS[name](path, seed=0, **overrides)
    loaded = load_model(path, PrefixSharingConfig(enabled=True, backend="torch_ref"))
    loaded.model.eval()  # eval: no MoE aux loss in the log-prob gradients (tests/test_qwen35_moe_aux_loss.py has it)
    return request.param, name, hf, loaded, path


def _samples(loaded, **kw):
    args = dict(num_prompts=3, n=4, prompt_len=(5, 40), response_len=(1, 12), seed=3)
    args.update(kw)
    return grpo_like_samples(loaded.vocab_size, **args)


def test_registration_detects_the_family_and_builds_our_modules(family):
    from ps_bridge.models.attention import PrefixSharedCoreAttention
    from ps_bridge.models.gpt_model import PrefixSharedGPTModel
    from ps_bridge.providers.gpt import PrefixSharedGPTProvider
    from ps_bridge.providers.registry import resolve_provider

    case, name, hf, loaded, _ = family
    assert resolve_provider(None, hf.config.architectures).name == name
    assert isinstance(loaded.provider, PrefixSharedGPTProvider) and isinstance(loaded.model, PrefixSharedGPTModel)
    layers = loaded.model.decoder.layers
    assert sum(isinstance(m, PrefixSharedCoreAttention) for m in loaded.model.modules()) == len(layers)
    attention = layers[0].self_attention
    head_dim = hf.config.head_dim if hasattr(hf.config, "head_dim") else hf.config.hidden_size // hf.config.num_attention_heads
    assert loaded.provider.kv_channels == head_dim
    if name.startswith("qwen3"):  # q/k RMSNorm per head on the prefix-shared attention, no q/k/v bias
        assert attention.q_layernorm.weight.shape == (head_dim,) and attention.k_layernorm.weight.shape == (head_dim,)
        assert attention.linear_qkv.bias is None
    if name == "qwen3-moe":
        dense = [i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "router")]
        step = hf.config.decoder_sparse_step
        expected = [i for i in range(len(layers)) if i in hf.config.mlp_only_layers or (i + 1) % step]
        assert dense == expected and dense
        assert loaded.provider.moe_router_pre_softmax == (not hf.config.norm_topk_prob)


def test_logits_equal_hf(family):
    case, _, hf, loaded, _ = family
    assert max_logit_diff_unshared_vs_hf(loaded, hf, _samples(loaded, num_prompts=2, n=1)) < 1e-5, case


def test_shared_logprobs_and_gradients_equal_unshared_and_hf(family):
    case, _, hf, loaded, _ = family
    r = compare(loaded, _samples(loaded), hf)
    assert r["tokens_shared"] < r["tokens_unshared"]
    for key in ("max_logprob_diff_shared_vs_hf", "max_logprob_diff_unshared_vs_hf", "max_logprob_diff_shared_vs_unshared"):
        assert r[key] <= 2e-5, (case, key, r[key])
    assert r["max_rel_grad_diff_shared_vs_unshared"] <= 2e-5, (case, r)


def test_every_gradient_equals_hf(family):
    """Every HF parameter (experts, q/k norms, the tied or untied head), matched by name through the bridge."""
    case, _, hf, loaded, _ = family
    r = hf_gradient_difference(loaded, hf, _samples(loaded, num_prompts=2, n=3, seed=5))
    assert r["parameters_compared"] == len(list(hf.parameters())), case
    assert r["max_rel_grad_diff_vs_hf"] <= 2e-5, (case, {k: v for k, v in r["per_parameter"].items() if v > 2e-5})


def test_padded_pack_parameter_gradients_shared_equal_unshared(family):
    case, _, _, loaded, _ = family
    samples = _samples(loaded, num_prompts=2, n=3, seed=7)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s.response), generator=gen) for s in samples]
    shared = param_grads(loaded, samples, True, weights, pad_multiple=4)
    unshared = param_grads(loaded, samples, False, weights, pad_multiple=4)
    assert shared.keys() == unshared.keys()
    worst = max(((shared[n] - unshared[n]).abs().max() / unshared[n].abs().max().clamp(min=1e-12)).item() for n in shared)
    assert worst <= 2e-5, (case, worst)


def test_prefix_trees_equal_hf_and_unshared(family):
    case, _, hf, loaded, _ = family
    samples = tree_samples(0)
    config = loaded.config
    saved = (config.tree, config.tree_min_shared)
    config.tree, config.tree_min_shared = True, 0
    try:
        shared = run_logprob_loss(loaded, samples, share=True)
    finally:
        config.tree, config.tree_min_shared = saved
    unshared = run_logprob_loss(loaded, samples, share=False)
    assert max_abs_diff(shared.logprobs, hf_logprobs(hf, samples)) <= 2e-5, case
    assert max_abs_diff(shared.logprobs, unshared.logprobs) <= 2e-5, case
    assert max_relative_grad_diff(shared.grads, unshared.grads) <= 2e-5, case


def test_export_round_trip_exact(family):
    case, _, _, loaded, path = family
    same_names, diff, mismatch = export_matches_checkpoint(loaded, path)
    assert same_names, (case, mismatch)
    assert diff == 0.0, (case, diff)


# ---- Llama 3 RoPE scaling at the layout's per-token positions --------------------------------------


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3_rope"))
    hf = TINY_BUILDERS["llama3"](path, seed=1)
    return hf, load_model(path, PrefixSharingConfig(enabled=True, backend="torch_ref")), path


def _long_prompt_samples(vocab_size):
    """Prompts of 60-90 tokens: responses sit past the checkpoint's original_max_position_embeddings (64)."""
    return grpo_like_samples(vocab_size, num_prompts=2, n=3, prompt_len=(60, 90), response_len=(4, 12), seed=11)


def test_llama3_scaled_rope_at_long_positions_equals_hf(llama3):
    hf, loaded, _ = llama3
    assert hf.config.rope_scaling["original_max_position_embeddings"] == 64
    samples = _long_prompt_samples(loaded.vocab_size)
    assert min(len(s.prompt) for s in samples) > 64
    with torch.no_grad():
        shared = per_sample_response_logprobs(loaded, samples, share=True)
        unshared = per_sample_response_logprobs(loaded, samples, share=False)
        ref = hf_sample_logprobs(hf, samples)
    assert max_abs(shared, ref) <= 2e-5 and max_abs(shared, unshared) <= 2e-5


def test_llama3_with_megatrons_fixed_scaling_differs_from_hf(llama3):
    """Negative control: megatron-core's own llama3 frequencies (original_max_position_embeddings fixed
    at 8192) move the log-probs at these positions, so the test above can fail."""
    hf, loaded, _ = llama3
    rope = loaded.model.rotary_pos_emb
    ours = rope.inv_freq
    megatron = rope._apply_scaling(1.0 / (10000.0 ** (torch.arange(0, ours.numel() * 2, 2, dtype=torch.float32) / (ours.numel() * 2))),
                                   factor=8.0)
    assert not torch.equal(ours, megatron)
    samples = _long_prompt_samples(loaded.vocab_size)
    rope.inv_freq = megatron
    try:
        with torch.no_grad():
            wrong = per_sample_response_logprobs(loaded, samples, share=True)
    finally:
        rope.inv_freq = ours
    assert max_abs(wrong, hf_sample_logprobs(hf, samples)) > 1e-3


def test_llama3_inv_freq_equals_megatron_and_hf_at_their_constants():
    """At megatron-core's fixed constants (1, 4, 8192) our frequencies are megatron's; at other
    constants they are transformers' own llama3 frequencies."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from ps_bridge.compat.megatron_bridge import llama3_inv_freq

    megatron = RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=500000, rope_scaling=True,
                               rope_scaling_factor=32.0, use_cpu_initialization=True).inv_freq
    torch.testing.assert_close(llama3_inv_freq(128, 500000.0, 32.0, 1.0, 4.0, 8192.0), megatron, rtol=0, atol=0)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 3.0,
            "original_max_position_embeddings": 100, "rope_theta": 10000.0}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=rope, rope_theta=10000.0)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(llama3_inv_freq(16, 10000.0, 8.0, 2.0, 3.0, 100.0), hf_inv_freq.float(), rtol=0, atol=1e-7)


def test_linear_rope_scaling_equals_hf(tmp_path):
    """RoPE scaling `linear` on Qwen3 (the stock Qwen3 bridge drops it): positions divided by the factor."""
    hf = TINY_BUILDERS["qwen3"](str(tmp_path), rope_scaling={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    loaded = load_model(str(tmp_path), PrefixSharingConfig(enabled=True, backend="torch_ref"))
    assert loaded.provider.seq_len_interpolation_factor == 4.0
    samples = grpo_like_samples(loaded.vocab_size, num_prompts=2, n=3, prompt_len=(20, 40), seed=2)
    with torch.no_grad():
        shared = per_sample_response_logprobs(loaded, samples, share=True)
    assert max_abs(shared, hf_sample_logprobs(hf, samples)) <= 2e-5


# ---- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "sliding-window attention"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                        "rope_theta": 10000.0}), "RoPE scaling 'yarn'"),
])
def test_nonstandard_attention_is_refused_by_name(tmp_path, overrides, message):
    from ps_bridge.providers.gpt import NonStandardAttentionError

    TINY_BUILDERS["qwen3"](str(tmp_path), **overrides)
    with pytest.raises(NonStandardAttentionError, match=message) as err:
        load_model(str(tmp_path), PrefixSharingConfig(enabled=True))
    assert "'qwen3' checkpoint" in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.parametrize("provider, hf_config, message", [
    (dict(multi_latent_attention=True), {}, "multi-latent attention"),
    ({}, dict(kv_lora_rank=512), "multi-latent attention"),
    (dict(softmax_type="learnable"), {}, "attention sinks"),
    ({}, dict(layer_types=["full_attention", "sliding_attention"]), "sliding-window attention"),
    (dict(window_size=(128, 0)), {}, "sliding-window attention"),
    (dict(attention_output_gate=True), {}, "gated or experimental attention"),
])
def test_refusal_rules(provider, hf_config, message):
    from ps_bridge.providers.gpt import NonStandardAttentionError, refuse_nonstandard_attention

    refuse_nonstandard_attention(SimpleNamespace(), SimpleNamespace(), "any")  # standard attention passes
    with pytest.raises(NonStandardAttentionError, match=message):
        refuse_nonstandard_attention(SimpleNamespace(**provider), SimpleNamespace(**hf_config), "any")


def test_one_registration_row_per_family():
    from ps_bridge.providers.gpt import REGISTRATIONS
    from ps_bridge.providers.registry import STANDARD_FAMILIES, get_provider_entry, provider_names

    for row in STANDARD_FAMILIES:
        assert row.name in provider_names()
        assert get_provider_entry(row.name).hf_architectures == (row.hf_architecture,)
    assert [r.name for r in REGISTRATIONS] == [f.name for f in STANDARD_FAMILIES]
