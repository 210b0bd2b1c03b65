"""tools/count_graph_buckets.py: verl-check's micro-batches packed in CUDA-graph buckets, counted on the
host: F over the bucketed packs, padding, structures and the steps of their captures."""

import importlib.util
import pathlib
import sys

import pytest

from ps_bridge.cuda_graphs import CAPTURE_AT
from ps_bridge.layout import Sample, build_layout
from ps_bridge.tools.bench.catalog import MODEL_SHAPES
from ps_bridge.tools.bench.flops import flop_shape, model_flops
from ps_bridge.tools.verl_check.config import CheckSettings
from ps_bridge.tools.verl_check.data import synthetic_tokens
import ps_bridge.tree.materialize as materialize

SPEC = importlib.util.spec_from_file_location(
    "count_graph_buckets", pathlib.Path(__file__).resolve().parents[1] / "tools" / "count_graph_buckets.py")
tool = sys.modules[SPEC.name] = importlib.util.module_from_spec(SPEC)  # its dataclass looks its module up
SPEC.loader.exec_module(tool)

ROW = dict(model="tiny-qwen3.5", layers=2, prompts=4, n=8, prompt_len=64, response_len=16, mini_batch=2, steps=6)


def _samples(step):
    settings = CheckSettings(model=ROW["model"], prompts=ROW["prompts"], n=ROW["n"], prompt_len=ROW["prompt_len"],
                             response_len=ROW["response_len"])
    vocab = flop_shape(MODEL_SHAPES[ROW["model"]], ROW["layers"]).vocab
    prompts, responses, lengths, _, _ = synthetic_tokens(settings, vocab, step)
    return [Sample(prompts[i].tolist(), responses[i, :int(lengths[i])].tolist()) for i in range(len(lengths))]


@pytest.mark.parametrize("buckets", ["segment", "level"])
def test_counts_follow_the_packs_of_each_step(buckets):
    before = materialize.RECENT_SHAPES
    counts = tool.count(buckets=buckets, **ROW)
    assert materialize.RECENT_SHAPES is before  # the process's recent shapes untouched
    shape = flop_shape(MODEL_SHAPES[ROW["model"]], ROW["layers"])
    logprobs, update = counts["log-probs"], counts["update"]
    assert logprobs.eager == update.eager == 0
    # the samples' own FLOPs, every step's micro-batches
    unshared = sum(model_flops(shape, build_layout(_samples(t), share=False)) for t in range(ROW["steps"]))
    assert logprobs.flops_unshared == pytest.approx(unshared) and update.flops_unshared == pytest.approx(unshared)
    # bucketed packs hold padding: F below that of the tight packs, padding counted in tokens
    tight = sum(model_flops(shape, build_layout(_samples(t), share="tree", prompt_values=False))
                for t in range(ROW["steps"]))
    assert unshared / tight > unshared / logprobs.flops_shared > 1
    assert logprobs.tokens_bucketed > logprobs.tokens
    # every structure seen CAPTURE_AT times is captured once, at the step where that happened
    for c in (logprobs, update):
        assert len(c.captures) == sum(1 for seen in c.seen.values() if seen >= CAPTURE_AT)
        assert c.captures == sorted(c.captures) and all(1 <= s <= ROW["steps"] for s in c.captures)
    assert sum(update.seen.values()) == 2 * ROW["steps"]  # two mini-batches a step
    assert "structures" in logprobs.line("row")


def test_packs_the_rule_runs_eagerly_are_counted_apart():
    """Segment buckets pad every response to the bucket of the longest: with responses of 24-72 tokens
    after prompts of 40, nearly every pack would hold more than 9/10 of the samples' tokens, and runs eagerly."""
    row = dict(ROW, n=4, prompt_len=40, response_len=48)
    counts = tool.count(buckets="segment", **row)
    assert counts["log-probs"].eager == row["steps"] and not counts["log-probs"].seen  # all prompts in one
    assert counts["log-probs"].line("row") == f"row: every pack eager ({row['steps']})"
    update = counts["update"]
    assert update.eager > row["steps"] and update.eager + sum(update.seen.values()) == 2 * row["steps"]
