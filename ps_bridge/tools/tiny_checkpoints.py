"""Tiny random Hugging Face checkpoints (no downloads) and Hugging Face's own log-probs on them:
the demo's model and the tests', and the `--smoke` runs'.

Each builder makes a small model with transformers' own class, seeds it, saves it to `path` and
returns the HF model (eval mode, float32) so a caller can compare against it.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List

import torch

from ps_bridge.layout import Sample


def build_tiny_qwen2(path: str, seed: int = 0, **overrides):
    # imported here: transformers is heavy
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs)).eval()
    # random init leaves biases at 0; give the qkv biases values so their mapping is exercised
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def _tiny_qwen35_text_kwargs(moe: bool) -> dict:
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=4,
        # several Gated DeltaNet layers and one full-attention layer, not at the end
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        # 2 key heads, 4 value heads: grouped value heads
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    )
    if moe:
        kwargs.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
        )
    else:
        kwargs.update(intermediate_size=128)
    return kwargs


def _perturb_qwen35_norms(model, seed: int) -> None:
    """Random init leaves the (1 + w) norms at w = 0 and the GDN out-norm at 1; give them values so
    that the zero-centred conversion (and the GDN out-norm's -1 mapping) is exercised."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "visual" not in name:
                p.add_(torch.randn(p.shape, generator=gen).to(p.device) * 0.1)


def build_tiny_qwen35(path: str, seed: int = 0, moe: bool = False, conditional: bool = False,
                      special_token_ids=(250, 251, 252, 253), **overrides):
    """Tiny Qwen3.5 checkpoint: `Qwen3_5[Moe]ForCausalLM`, or with `conditional=True` the
    `Qwen3_5[Moe]ForConditionalGeneration` architecture the official checkpoints declare (a tiny
    vision tower included, its image, video, vision start and vision end token ids `special_token_ids`)."""
    torch.manual_seed(seed)
    text = _tiny_qwen35_text_kwargs(moe)
    text.update(overrides)
    if moe:
        # imported here: transformers is heavy
        from transformers import (
            Qwen3_5MoeConfig as VLConfig,
            Qwen3_5MoeForCausalLM as LM,
            Qwen3_5MoeForConditionalGeneration as VLM,
            Qwen3_5MoeTextConfig as TextConfig,
        )
    else:
        # imported here: transformers is heavy
        from transformers import (
            Qwen3_5Config as VLConfig,
            Qwen3_5ForCausalLM as LM,
            Qwen3_5ForConditionalGeneration as VLM,
            Qwen3_5TextConfig as TextConfig,
        )
    if conditional:
        vision = dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
            num_position_embeddings=16,
        )
        image, video, start, end = special_token_ids
        config = VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, image_token_id=image,
                          video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
        model = VLM(config).eval()
        _save_tiny_image_processor(path, vision)
    else:
        model = LM(TextConfig(**text)).eval()
    _perturb_qwen35_norms(model, seed)
    model.save_pretrained(path)
    return model


def _save_tiny_image_processor(path: str, vision: dict) -> None:
    """The tiny vision tower's image processor (`preprocessor_config.json`, what `ps-bridge logprobs`
    turns image files with): Qwen3.5's, at the tower's patch, temporal patch and merge sizes, for images
    of 8x8 to 64x64 pixels."""
    # imported here: transformers is heavy; its PIL form needs no torchvision
    from transformers import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"], size={"shortest_edge": 64, "longest_edge": 64 * 64},
    ).save_pretrained(path)


def build_tiny_qwen35_moe(path: str, seed: int = 0, **overrides):
    return build_tiny_qwen35(path, seed=seed, moe=True, **overrides)


def build_tiny_qwen35_vl(path: str, seed: int = 0, **overrides):
    return build_tiny_qwen35(path, seed=seed, conditional=True, **overrides)


def build_tiny_qwen35_moe_vl(path: str, seed: int = 0, **overrides):
    return build_tiny_qwen35(path, seed=seed, moe=True, conditional=True, **overrides)


def _perturb_norms(model, seed: int) -> None:
    """Random init leaves RMSNorm weights at 1: give them values so that each norm's mapping (q/k
    norms per head included) is exercised."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def build_tiny_qwen3(path: str, seed: int = 0, **overrides):
    """Tiny Qwen3 dense: head_dim 24 with hidden 64 and 4 query heads (not hidden / heads), 2 KV heads,
    q/k norms per head, no q/k/v bias, an odd vocabulary, untied embeddings."""
    # imported here: transformers is heavy
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, max_position_embeddings=512, rope_theta=10000.0,
                  tie_word_embeddings=False)
    kwargs.update(overrides)
    model = Qwen3ForCausalLM(Qwen3Config(**kwargs)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(path)
    return model


def build_tiny_qwen3_moe(path: str, seed: int = 0, **overrides):
    """Tiny Qwen3 MoE: 4 layers, layer 1 dense (`mlp_only_layers`), 4 routed experts top-2 with
    `norm_topk_prob`, no shared expert; head_dim 24 (not hidden / heads), an odd vocabulary."""
    # imported here: transformers is heavy
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=251, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                  max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
    kwargs.update(overrides)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kwargs)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(path)
    return model


def build_tiny_llama3(path: str, seed: int = 0, **overrides):
    """Tiny Llama 3: one KV head (MQA), tied embeddings, an odd vocabulary, RoPE scaling `llama3` with
    original_max_position_embeddings 64: wavelengths above 64 positions are scaled, those between 16
    and 64 interpolated, so positions past 64 see scaled frequencies (megatron-core's fixed 8192 would
    not scale them the same)."""
    # imported here: transformers is heavy
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64, "rope_theta": 10000.0},
                  rope_theta=10000.0)
    kwargs.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(path)
    return model


# name -> builder (registry names; the ConditionalGeneration forms carry a "-vl" suffix)
TINY_BUILDERS: Dict[str, Callable] = {
    "qwen2.5": build_tiny_qwen2,
    "qwen3.5": build_tiny_qwen35,
    "qwen3.5-moe": build_tiny_qwen35_moe,
    "qwen3.5-vl": build_tiny_qwen35_vl,
    "qwen3.5-moe-vl": build_tiny_qwen35_moe_vl,
    "qwen3": build_tiny_qwen3,
    "qwen3-moe": build_tiny_qwen3_moe,
    "llama3": build_tiny_llama3,
}


def grpo_like_samples(
    vocab_size: int,
    num_prompts: int = 3,
    n: int = 4,
    prompt_len=(5, 24),
    response_len=(1, 12),
    seed: int = 0,
    shuffle: bool = True,
) -> List[Sample]:
    """Several prompts with n responses each, uneven lengths, optionally interleaved."""
    rng = random.Random(seed)
    samples = []
    for p in range(num_prompts):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))]
        for _ in range(n):
            response = [rng.randrange(vocab_size) for _ in range(rng.randint(*response_len))]
            samples.append(Sample(prompt, response, uid=f"p{p}"))
    if shuffle:
        rng.shuffle(samples)
    return samples


def fold_into_vocabulary(samples: List[Sample], vocab_size: int) -> List[Sample]:
    """`samples` with every token id taken modulo `vocab_size`: batches drawn for one vocabulary (their
    lengths, which tests size budgets by) on a checkpoint with a smaller one."""
    return [Sample([t % vocab_size for t in s.prompt], [t % vocab_size for t in s.response], uid=s.uid) for s in samples]


def system_prompt_samples(
    vocab_size: int,
    system_len: int = 20,
    num_prompts: int = 3,
    n: int = 3,
    prompt_len=(4, 8),
    response_len=(2, 8),
    turns: int = 3,
    observation_len: int = 3,
    seed: int = 0,
) -> List[Sample]:
    """A prefix tree's micro-batch: every prompt begins with one system prompt of `system_len` tokens,
    n responses per prompt (uid `p<k>`, adjacent), then a multi-turn chain of `turns` samples (uid
    `t<k>`): each turn's prompt holds the previous turn's whole sequence plus an observation."""
    rng = random.Random(seed)
    tokens = lambda k: [rng.randrange(vocab_size) for _ in range(k)]  # noqa: E731
    system = tokens(system_len)
    samples = []
    for p in range(num_prompts):
        prompt = system + tokens(rng.randint(*prompt_len))
        samples += [Sample(prompt, tokens(rng.randint(*response_len)), uid=f"p{p}") for _ in range(n)]
    sequence = system + tokens(rng.randint(*prompt_len))
    for t in range(turns):
        response = tokens(rng.randint(*response_len))
        samples.append(Sample(list(sequence), response, uid=f"t{t}"))
        sequence = sequence + response + tokens(observation_len)
    return samples


def hf_image_inputs(hf_model, sample, ids) -> dict:
    """The keyword arguments transformers' ConditionalGeneration forward takes for `sample`'s images
    (`Sample.images`): pixel values, grids and the token types its mRoPE index reads; {} without."""
    if not getattr(sample, "images", None):
        return {}
    image_token = hf_model.config.image_token_id
    return dict(
        pixel_values=torch.cat([span.image.pixel_values for span in sample.images]).to(hf_model.dtype),
        image_grid_thw=torch.tensor([span.image.grid_thw for span in sample.images]),
        mm_token_type_ids=(ids == image_token).int(),
    )


def hf_sample_logprobs(hf_model, samples) -> List[torch.Tensor]:
    """Hugging Face per-sequence log-probs of each response token (the unshared ground truth)."""
    out = []
    for s in samples:
        ids = torch.tensor([list(s.prompt) + list(s.response)])
        logits = hf_model(ids, **hf_image_inputs(hf_model, s, ids)).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        P = len(s.prompt)
        out.append(lp[P - 1 : -1].gather(1, ids[0, P:, None]).squeeze(1))
    return out
