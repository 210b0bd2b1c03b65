"""MoE router statistics other than the load-balancing loss under prefix sharing (Qwen3.5-MoE, CPU fp32).

The aux-loss-free expert bias (`moe_router_enable_expert_bias`) counts routed tokens per expert;
megatron counts every packed token once, so with a shared prompt the counts (and the bias update)
would silently differ from the unshared run. It is refused by name while it is not weighted.
"""

import pytest
import torch

from qwen35_helpers import layout_for, load_tiny, samples_for
from ps_bridge.models.moe import PrefixSharedTopKRouter


@pytest.fixture(scope="module")
def moe_with_expert_bias(tmp_path_factory):
    """The tiny Qwen3.5-MoE with megatron's expert bias switched on after loading (Megatron-Bridge's
    Qwen3.5 mapping has no HF tensor for `router.expert_bias`, so a model built with it cannot load)."""
    _, loaded, _ = load_tiny("qwen3.5-moe", tmp_path_factory)
    routers = [m for m in loaded.model.modules() if isinstance(m, PrefixSharedTopKRouter)]
    assert routers
    loaded.provider.moe_router_enable_expert_bias = True
    for r in routers:
        r.config.moe_router_enable_expert_bias = True  # the config finalize_model_grads reads
        r.enable_expert_bias = True
        del r.local_tokens_per_expert, r.expert_bias  # None attributes when built without it
        r.register_buffer("local_tokens_per_expert", torch.zeros(r.config.num_moe_experts), persistent=False)
        r.register_buffer("expert_bias", torch.zeros(r.config.num_moe_experts))
    return loaded, routers


def test_expert_bias_refused_by_name_in_training(moe_with_expert_bias):
    from ps_bridge.runtime import forward_logits

    loaded, _ = moe_with_expert_bias
    layout = layout_for(loaded, samples_for(loaded, num_prompts=2, n=3), share=True)
    loaded.model.train()
    try:
        with pytest.raises(NotImplementedError, match="moe_router_enable_expert_bias"):
            forward_logits(loaded, layout)
    finally:
        loaded.model.eval()
    with torch.no_grad():  # no gradient, no bias-count update: log-probs are exact and allowed
        forward_logits(loaded, layout)
