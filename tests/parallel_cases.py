"""The micro-batches every parallel test runs, shared by the torchrun workers and the reference."""

from typing import List

import torch

from ps_bridge.compare import loss_weights
from ps_bridge.layout import Sample
from ps_bridge.testing import grpo_like_samples

# DESIGN.md section 6: valid lengths [5, 2] become padded [6, 2] at TP=2
PADDING_EXAMPLE = Sample([11, 12, 13, 14, 15], [16, 17])


def parallel_micro_batches() -> List[List[Sample]]:
    """Micro-batches of different packed lengths (pipeline stages must exchange shapes), one
    group split across two of them, and the padding example on its own."""
    groups = grpo_like_samples(256, num_prompts=3, n=4, prompt_len=(6, 20), response_len=(1, 9), seed=21, shuffle=False)
    return [[PADDING_EXAMPLE], groups[:6], groups[6:]]


def micro_batch_weights(micro_batches) -> List[List[torch.Tensor]]:
    return [loss_weights(mb, seed=i) for i, mb in enumerate(micro_batches)]
