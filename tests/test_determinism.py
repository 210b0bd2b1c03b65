"""Repeated float32 CPU runs of the shared path give bit-identical log-probs.

A user saw `ps-bridge logprobs --dtype float32` (Qwen2, MQA, 23 samples in 6 groups, 2 CPU threads)
give a rarely different, less exact result. It was not reproduced on the project's machines (CLI
runs idle and under load, with OMP_DYNAMIC, in-process runs at 1 to 4 threads, with
several hash seeds, inputs at shifted alignments, dirty and NaN-filled memory: all identical), so
these are regression guards for the causes looked for, not proof of a fix:

- repeated runs in one process, at 1 and at 2 threads, are identical to the first, bit for bit;
- the shared path reads no uninitialised memory: with torch's deterministic mode every
  `torch.empty*` buffer (ours and ATen's) is filled with NaN (integers with their maximum), and the
  log-probs must stay bit-identical to a normal run, also with padded segments (as TP gives).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils.deterministic

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.tools.runtime import load_model
from ps_bridge.tools.schedule import logprob_pass
from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2, grpo_like_samples


@pytest.fixture(scope="module")
def mqa_case(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_mqa")
    build_tiny_qwen2(str(path), num_key_value_heads=1)  # MQA, as reported
    loaded = load_model(str(path), PrefixSharingConfig(enabled=True, backend="torch_ref"))
    samples = grpo_like_samples(loaded.vocab_size, num_prompts=6, n=4, prompt_len=(10, 60), response_len=(3, 30), seed=3)[:23]
    return loaded, samples


@contextlib.contextmanager
def threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def nan_filled_empty_memory():
    """torch's deterministic mode: every uninitialised buffer starts as NaN / the integer maximum."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.utils.deterministic.fill_uninitialized_memory = saved[1]


def shared_logprobs(loaded, samples) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(logprob_pass(loaded, [samples], share=True)[0])


def assert_bit_identical(run: torch.Tensor, first: torch.Tensor, what: str) -> None:
    assert torch.equal(run, first), (
        f"{what} differs from the first run on {int((run != first).sum())} tokens, "
        f"by up to {(run - first).abs().max():.3e} (NaN: {int(run.isnan().sum())})"
    )


@pytest.mark.parametrize("num_threads", [1, 2])
def test_shared_path_is_bit_identical_run_to_run(mqa_case, num_threads):
    loaded, samples = mqa_case
    with threads(num_threads):
        runs = [shared_logprobs(loaded, samples) for _ in range(12)]
    for k, run in enumerate(runs[1:], 1):
        assert_bit_identical(run, runs[0], f"run {k} at {num_threads} thread(s)")


@pytest.mark.parametrize("pad_multiple", [None, 4])
def test_shared_path_reads_no_uninitialised_memory(mqa_case, pad_multiple):
    loaded, samples = mqa_case
    saved = loaded.config.pad_multiple
    loaded.config.pad_multiple = pad_multiple  # None: the TP size (1), no padding
    try:
        with threads(2):
            normal = shared_logprobs(loaded, samples)
            with nan_filled_empty_memory():
                filled = shared_logprobs(loaded, samples)
    finally:
        loaded.config.pad_multiple = saved
    assert torch.isfinite(normal).all()
    assert_bit_identical(filled, normal, f"the run on NaN-filled empty memory (pad_multiple={pad_multiple})")
