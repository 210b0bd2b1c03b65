"""Property: on any micro-batch (group sizes, lengths, interleaving, a group split across two
micro-batches, TP-style padding), prefix-shared log-probs equal the unshared ones."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ps_bridge.tools.compare import max_abs_diff, run_logprob_loss
from ps_bridge.layout import Sample


@st.composite
def micro_batches(draw):
    groups = draw(st.integers(1, 4))
    samples = []
    for g in range(groups):
        prompt = draw(st.lists(st.integers(0, 255), min_size=1, max_size=12))
        n = draw(st.integers(1, 4))
        for _ in range(n):
            response = draw(st.lists(st.integers(0, 255), min_size=1, max_size=6))
            samples.append(Sample(prompt, response))
    order = draw(st.permutations(range(len(samples))))
    samples = [samples[i] for i in order]
    split = draw(st.integers(0, len(samples) - 1))
    pad = draw(st.sampled_from([1, 2, 4]))
    return samples, split, pad


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=micro_batches())
def test_shared_equals_unshared_on_random_micro_batches(qwen2_loaded, batch):
    samples, split, pad = batch
    qwen2_loaded.config.pad_multiple = pad
    try:
        reference = run_logprob_loss(qwen2_loaded, samples, share=False, backward=False)
        parts = [samples[:split], samples[split:]] if split else [samples]
        shared = []
        for part in parts:
            shared += run_logprob_loss(qwen2_loaded, part, share=True, backward=False).logprobs
    finally:
        qwen2_loaded.config.pad_multiple = None
    assert max_abs_diff(shared, reference.logprobs) <= 1e-5
