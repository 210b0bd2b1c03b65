"""Prefix trees under every parallel layout, on CPU with gloo (2 ranks, `torchrun`): TP=2+SP, PP=2,
CP=2 (contiguous shards of the tree pack, the head-parallel all-to-all) and EP=2 (whole subtrees
per data-parallel rank, a root shared by the whole micro-batch computed on both ranks).

The micro-batches are random trees (`parallel_cases.tree_micro_batches`: a system prompt shared
across prompts, depth up to 4, samples that are prefixes of others, identical samples, one tree
split across two micro-batches; under EP also two deep trees in one micro-batch, one per rank,
`tree_ep_micro_batches`), packed with `share="tree"` at threshold 0. Every run must give the
log-probs of Hugging Face (2e-5) and of the single-rank unshared run (1e-5, forward+backward and
forward only) and every HF-named parameter gradient of the single-rank unshared run (1e-5
relative), for Qwen2.5, Qwen3.5 dense and MoE (under EP the load-balancing loss too: each rank's
share, summed over the ranks, equals the single-rank value). Every rank must log tree layouts
(depth >= 2). One cheap case runs by default, the rest are `slow`.
"""

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import (  # noqa: E402
    MICRO_BATCHES, WORKER, aux_by_micro_batch, data_parallel_unshared, max_logprob_diff, micro_batch_weights,
    rank_local_router_statistics, recorded_aux_losses, relative_grad_diffs, torchrun,
)

# name: (architecture, worker flags); every case runs on 2 processes
CASES = {
    "qwen2.5_cp2": ("qwen2.5", ["--cp", "2"]),
    "qwen2.5_tp2_sp": ("qwen2.5", ["--tp", "2", "--sp"]),
    "qwen2.5_pp2": ("qwen2.5", ["--pp", "2"]),
    "qwen3.5_tp2_sp": ("qwen3.5", ["--tp", "2", "--sp"]),
    "qwen3.5_pp2": ("qwen3.5", ["--pp", "2"]),
    "qwen3.5_cp2": ("qwen3.5", ["--cp", "2"]),
    "qwen3.5-moe_tp2_sp": ("qwen3.5-moe", ["--tp", "2", "--sp"]),
    "qwen3.5-moe_pp2": ("qwen3.5-moe", ["--pp", "2"]),
    "qwen3.5-moe_cp2": ("qwen3.5-moe", ["--cp", "2"]),
    "qwen3.5-moe_ep2": ("qwen3.5-moe", ["--ep", "2"]),  # on `tree_ep` micro-batches (two roots in the last)
    "qwen3_tp2_sp": ("qwen3", ["--tp", "2", "--sp"]),
    "qwen3_cp2": ("qwen3", ["--cp", "2"]),
    "qwen3-moe_pp2": ("qwen3-moe", ["--pp", "2"]),
    "qwen3-moe_ep2": ("qwen3-moe", ["--ep", "2"]),  # on `tree_ep` micro-batches
    "llama3_pp2": ("llama3", ["--pp", "2"]),
    "llama3_tp2_sp": ("llama3", ["--tp", "2", "--sp"]),
    "llama3_cp2": ("llama3", ["--cp", "2"]),
}
DEFAULT_SUITE = {"qwen2.5_cp2"}


@pytest.fixture(scope="module")
def tree_reference(tmp_path_factory):
    """(checkpoint path, single-rank unshared log-probs / gradients / aux losses, HF log-probs) on
    the tree micro-batches (`cases`: `tree` or `tree_ep`), per architecture, built once."""
    from transformers import AutoModelForCausalLM

    from ps_bridge.tools.compare import hf_logprobs
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.parallel.gradients import hf_named_gradients
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.schedule import logprob_pass
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    cache = {}

    def get(arch, cases):
        if (arch, cases) not in cache:
            path = str(tmp_path_factory.mktemp(arch))
            TINY_BUILDERS[arch](path)
            loaded = load_model(path, PrefixSharingConfig(enabled=True))
            micro_batches = MICRO_BATCHES[cases]()
            loaded.model.zero_grad(set_to_none=True)
            with recorded_aux_losses() as records:
                logprobs = logprob_pass(loaded, micro_batches, share=False, loss_weights=micro_batch_weights(micro_batches))
            grads = hf_named_gradients(loaded.bridge, loaded.model)
            aux = aux_by_micro_batch(records)
            if cases == "tree_ep" and rank_local_router_statistics(loaded):
                # each DP rank's aux loss is that of its own subtrees (the split the worker's --tree run makes)
                options = dict(min_shared=0, max_depth=None)
                aux, grads = data_parallel_unshared(loaded, micro_batches, dp_size=2, tree_options=options)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[(arch, cases)] = (path, dict(logprobs=logprobs, grads=grads, aux=aux),
                           [hf_logprobs(hf, mb) for mb in micro_batches])
        return cache[(arch, cases)]

    return get


def check_tree_logs(stderr: str) -> None:
    """Both ranks packed prefix trees: each rank's `[PS][prepare]` layout lines include depth >= 2
    (the second half of a split tree, a rank's part under EP, may be shallower)."""
    for rank in range(2):
        depths = [int(m.group(1)) for m in re.finditer(
            rf"\[PS\]\[prepare\]\[global_rank={rank} [^\]]*\][^\n]* packed_batch_layout: [^\n]* depth=(\d+),", stderr)]
        assert depths and max(depths) >= 2, f"rank {rank}: tree depths {depths}\n{stderr[-3000:]}"


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT_SUITE else [pytest.mark.slow]) for n in CASES])
def test_tree_parallel_run_equals_single_rank_unshared_and_hf(name, tree_reference, tmp_path):
    arch, flags = CASES[name]
    cases = "tree_ep" if "--ep" in flags else "tree"
    path, ref, hf = tree_reference(arch, cases)
    out = tmp_path / "result.pt"
    proc = torchrun(2, [WORKER, "--hf-path", path, "--out", str(out), "--cases", cases, "--tree", *flags], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    logprob_diff = max_logprob_diff(got["logprobs"], ref["logprobs"])
    hf_diff = max_logprob_diff(got["logprobs"], hf)
    diffs = relative_grad_diffs(got["grads"], ref["grads"])
    print(f"{name}: max |logp| diff {logprob_diff:.2e} (HF {hf_diff:.2e}), max relative grad diff {max(diffs.values()):.2e}")
    assert logprob_diff <= 1e-5 and hf_diff <= 2e-5
    assert max_logprob_diff(got["forward_only"], ref["logprobs"]) <= 1e-5
    wrong = {n: f"{d:.2e}" for n, d in diffs.items() if not d <= 1e-5}
    assert not wrong, f"{name}: gradients differ (relative): {wrong}"
    check_tree_logs(proc.stderr)
    if "--ep" in flags:  # data-parallel ranks: each rank's aux loss is its share of the micro-batch's
        assert set(got["aux"]) == set(ref["aux"]) and ref["aux"], (sorted(got["aux"]), sorted(ref["aux"]))
        aux_diff = max(abs(got["aux"][k] - v) / abs(v) for k, v in ref["aux"].items())
        assert aux_diff <= 1e-5, (got["aux"], ref["aux"])
        # the shared root is computed on both ranks: each logs its own part of every micro-batch
        samples = re.findall(r"\[PS\]\[prepare\]\[global_rank=(\d) [^\]]*\][^\n]* packed_batch_layout: [^\n]* samples=(\d+),", proc.stderr)
        per_rank = {r: [int(n) for rr, n in samples if rr == r] for r in "01"}
        assert per_rank["0"] and per_rank["1"], per_rank
