"""Repeated float32 CPU runs of the shared path give bit-identical log-probs (issue 10, item 7).

A user saw `ps-bridge logprobs --dtype float32` (Qwen2, MQA, 23 samples in 6 groups, 2 CPU threads)
give a rarely different, less exact result. It was not reproduced on the project's machines (107 CLI
runs and 300 in-process runs, all identical), so this is a regression guard, not a proof of a fix: it
repeats the shared forward pass in one process at 2 threads and requires every run to be identical
to the first, bit for bit."""

from __future__ import annotations

import torch

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.runtime import load_model
from ps_bridge.schedule import logprob_pass
from ps_bridge.tiny_checkpoints import build_tiny_qwen2, grpo_like_samples


def test_shared_path_is_bit_identical_run_to_run(tmp_path):
    build_tiny_qwen2(str(tmp_path), num_key_value_heads=1)  # MQA, as reported
    loaded = load_model(str(tmp_path), PrefixSharingConfig(enabled=True, backend="torch_ref"))
    samples = grpo_like_samples(loaded.vocab_size, num_prompts=6, n=4, prompt_len=(10, 60), response_len=(3, 30), seed=3)[:23]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            runs = [logprob_pass(loaded, [samples], share=True)[0] for _ in range(12)]
    finally:
        torch.set_num_threads(threads)
    first = torch.cat(runs[0])
    for k, run in enumerate(runs[1:], 1):
        assert torch.equal(torch.cat(run), first), f"run {k} differs from run 0 by {(torch.cat(run) - first).abs().max():.3e}"
