"""Tiny random Hugging Face checkpoints for tests and the demo (no downloads).

Each builder makes a small model with transformers' own class, seeds it, saves it to `path` and
returns the HF model (eval mode, float32) so a caller can compare against it.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List

import torch

from ps_bridge.layout import Sample


def build_tiny_qwen2(path: str, seed: int = 0, **overrides):
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


# name -> builder; the Qwen3.5 work adds its own entries
TINY_BUILDERS: Dict[str, Callable] = {"qwen2.5": build_tiny_qwen2}


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


def hf_sample_logprobs(hf_model, samples) -> List[torch.Tensor]:
    """Hugging Face per-sequence log-probs of each response token (the unshared ground truth)."""
    out = []
    for s in samples:
        ids = torch.tensor([list(s.prompt) + list(s.response)])
        logits = hf_model(ids).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        P = len(s.prompt)
        out.append(lp[P - 1 : -1].gather(1, ids[0, P:, None]).squeeze(1))
    return out
