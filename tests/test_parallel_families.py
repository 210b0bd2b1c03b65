"""The standard-attention families (Qwen3 dense, Qwen3 MoE, Llama 3) under TP=2+SP, PP=2 and CP=2 on
CPU with gloo, launched with `torchrun`, as tests/test_parallel.py and test_context_parallel.py do for
Qwen2.5: the prefix-shared parallel run gives the log-probs and every HF-named gradient of the
single-rank unshared run (within 1e-5).

What this adds: q/k norms per head whose gradients are partial per TP rank (each rank holds half the
heads), head_dim not hidden / heads, one KV head replicated over TP (Llama 3's MQA), an odd vocabulary
padded for TP, tied embeddings split over PP (Llama 3), a dense layer among MoE layers on its own
pipeline stage, the MoE router under TP+SP and CP, llama3 RoPE scaling under CP's shards. Prefix trees: tests/test_tree_parallel.py.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import run_and_compare, single_rank_unshared  # noqa: E402

# vocabularies above the parallel cases' token ids (< 256), odd so that TP=2 pads them
CHECKPOINTS = {
    "qwen3": ("qwen3", dict(vocab_size=257)),
    "qwen3-moe": ("qwen3-moe", dict(vocab_size=257)),
    "llama3": ("llama3", dict(vocab_size=259)),
}
LAYERS = {"qwen3": 2, "qwen3-moe": 4, "llama3": 2}

# name: (checkpoint, processes, worker flags, tp, pp, cp, micro-batches, default suite)
CASES = {
    "qwen3_tp2": ("qwen3", 2, ["--tp", "2"], 2, 1, 1, "parallel", False),
    "qwen3_tp2_sp": ("qwen3", 2, ["--tp", "2", "--sp"], 2, 1, 1, "parallel", True),
    "qwen3_pp2": ("qwen3", 2, ["--pp", "2"], 1, 2, 1, "parallel", False),
    "qwen3_cp2": ("qwen3", 2, ["--cp", "2"], 1, 1, 2, "cp", False),
    "qwen3-moe_tp2_sp": ("qwen3-moe", 2, ["--tp", "2", "--sp"], 2, 1, 1, "parallel", False),
    "qwen3-moe_pp2": ("qwen3-moe", 2, ["--pp", "2"], 1, 2, 1, "parallel", True),
    "qwen3-moe_cp2": ("qwen3-moe", 2, ["--cp", "2"], 1, 1, 2, "cp", False),
    "llama3_tp2_sp": ("llama3", 2, ["--tp", "2", "--sp"], 2, 1, 1, "parallel", False),
    "llama3_pp2_tied": ("llama3", 2, ["--pp", "2"], 1, 2, 1, "parallel", False),
    "llama3_cp2": ("llama3", 2, ["--cp", "2"], 1, 1, 2, "cp", False),
}


@pytest.fixture(scope="module")
def family_case(tmp_path_factory):
    """(checkpoint path, single-rank unshared reference on the micro-batches), built once each."""
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    paths, refs = {}, {}

    def get(name, cases):
        if name not in paths:
            builder, overrides = CHECKPOINTS[name]
            paths[name] = str(tmp_path_factory.mktemp(name))
            TINY_BUILDERS[builder](paths[name], **overrides)
        if (name, cases) not in refs:
            refs[name, cases] = single_rank_unshared(load_model(paths[name], PrefixSharingConfig(enabled=True)), cases=cases)
        return paths[name], refs[name, cases]

    return get


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if c[-1] else [pytest.mark.slow]) for n, c in CASES.items()])
def test_family_parallel_run_equals_single_rank_unshared(name, family_case, tmp_path):
    checkpoint, nproc, flags, tp, pp, cp, cases, _ = CASES[name]
    hf_path, ref = family_case(checkpoint, cases)
    if cp > 1:
        run_and_compare(name, nproc, flags, tp, pp, hf_path, ref, tmp_path, cp=cp, cases=cases)
    else:
        run_and_compare(name, nproc, flags, tp, pp, hf_path, ref, tmp_path, num_layers=LAYERS[checkpoint])
