"""`ps-bridge bench` where the shared micro-batch does not fit in GPU memory at once (the Qwen3.5-9B
shape's `search` and `system` trees: 248k-vocabulary logits): the shared packing then runs split
into micro-batches by the verl engine's rule (`tree.split.budget_micro_batches`), its log-probs in
the samples' order, and F counts the prefixes each part computes. On a CPU, with the out-of-memory
error raised for the whole micro-batch."""

from __future__ import annotations

import argparse
import json

import torch

from ps_bridge.tools import bench
from ps_bridge.tools.bench import timing


def system_tree_row(capsys):
    """`ps-bridge bench --smoke --trees system` on the tiny Qwen2.5 shape: (exit status, output, its row)."""
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    args = parser.parse_args(["--smoke", "--no-progress", "--models", "tiny-qwen2.5", "--trees", "system",
                              "--json", "-"])
    status = bench.run_bench(args)
    out = capsys.readouterr().out
    (row,) = json.loads(out[out.index("{"):])["rows"]
    return status, out, row


def test_shared_run_splits_when_the_whole_tree_does_not_fit(capsys, monkeypatch):
    real = timing.run_mode
    ran = []

    def whole_does_not_fit(loaded, layouts, backend, **kw):
        parts = layouts if isinstance(layouts, (list, tuple)) else [layouts]
        if any(p.shared for p in parts):
            ran.append([(p.num_samples, p.tokens_shared) for p in parts])
            if len(parts) == 1:
                raise torch.cuda.OutOfMemoryError("whole tree (simulated)")
        return real(loaded, layouts, backend, **kw)

    monkeypatch.setattr(timing, "run_mode", whole_does_not_fit)
    status, out, row = system_tree_row(capsys)
    assert status == 0
    whole, split = ran[0], ran[1]
    assert len(whole) == 1 and len(split) >= 2  # tried whole, then split (at most half its tokens each)
    samples = whole[0][0]
    assert sum(n for n, _ in split) == samples
    # each part computes the system prompt: more packed tokens than the whole tree, fewer than unshared
    assert whole[0][1] < sum(t for _, t in split) < row["tokens_unshared"]
    assert row["shared"]["micro_batches"] == len(split) and row["error"] is None
    # the log-probs, put back in the samples' order, equal the unshared run's
    assert row["max_logprob_diff"] < 2e-5
    # F: of the micro-batches that ran (each part computes the system prompt), below the whole tree's
    from ps_bridge.tools.bench.catalog import MODEL_SHAPES, TREE_SHAPES
    from ps_bridge.tools.bench.flops import flop_ratio, flop_shape

    samples = TREE_SHAPES["system"].samples(256, 1234, smoke=True)  # F reads lengths and sharing
    whole_F = flop_ratio(flop_shape(MODEL_SHAPES["tiny-qwen2.5"], row["layers"]), samples)
    assert 1 < row["flop_ratio"] < whole_F
    assert f"{len(split)} shared micro-batches" in out


def test_a_shared_run_that_never_fits_names_the_last_allocation(capsys, monkeypatch):
    """No split fits: the row's error carries the first line of the last out-of-memory error (torch's
    says how much it tried to allocate and how much was free)."""
    real = timing.run_mode

    def never_fits(loaded, layouts, backend, **kw):
        parts = layouts if isinstance(layouts, (list, tuple)) else [layouts]
        if any(p.shared for p in parts):
            raise torch.cuda.OutOfMemoryError(f"Tried to allocate {len(parts)}.00 GiB (simulated)\nmore lines")
        return real(loaded, layouts, backend, **kw)

    monkeypatch.setattr(timing, "run_mode", never_fits)
    _, _, row = system_tree_row(capsys)
    assert "did not fit in GPU memory even as" in row["error"]
    tried = int(row["error"].split("micro-batches")[0].split()[-1])
    assert f"(Tried to allocate {tried}.00 GiB (simulated))" in row["error"] and "more lines" not in row["error"]


def test_an_attempt_that_runs_out_of_memory_in_an_mlp_leaves_nothing_allocated(monkeypatch):
    """megatron-core's `TransformerLayer` keeps its MLP's input (and through it the autograd graph of the
    earlier layers) when the MLP raises; the bench's retry releases it (`compat.megatron_core.
    release_failed_forward`), so the failed attempt's activations are freed before the next one."""
    import gc

    import megatron.core.transformer.mlp as megatron_mlp

    from ps_bridge.compat.megatron_core import release_failed_forward
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.bench.catalog import make_samples, qwen2_hf_config
    from ps_bridge.tools.runtime import load_model_from_hf_config

    dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    loaded = load_model_from_hf_config(qwen2_hf_config(dims, 3), PrefixSharingConfig(enabled=True, backend="torch_ref"))
    layout = timing.build_layout(make_samples(64, 16, 4, 1, 1000, 0), share=False, vocab_size=1000)
    params = {id(p) for p in loaded.model.parameters()}

    def activations():
        gc.collect()
        return sum(t.numel() for t in gc.get_objects()
                   if isinstance(t, torch.Tensor) and id(t) not in params and t.numel() >= layout.num_tokens * 64)

    real_forward, calls = megatron_mlp.MLP.forward, []

    def third_mlp_runs_out_of_memory(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("in the third layer's MLP (simulated)")
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(megatron_mlp.MLP, "forward", third_mlp_runs_out_of_memory)
    timing_args = dict(warmup=1, repeats=1, chunk=1024, progress=lambda *a: None)
    before = activations()
    try:
        timing.run_mode(loaded, layout, "torch_ref", **timing_args)
    except torch.cuda.OutOfMemoryError:
        pass
    if any(hasattr(m, "mlp_norm_manager") for m in loaded.model.modules()):  # megatron-core 0.19's fault
        assert activations() > before
        assert release_failed_forward(loaded.model) == 1  # the third layer
    assert release_failed_forward(loaded.model) == 0
    assert activations() == before
    # the bench's retry does it: the next attempt starts with nothing of the failed one held (a forward
    # that reaches the layer's MLP again would drop it too; one that runs out of memory before does not)
    calls.clear()
    held_at_start = []

    def run_mode(*args, **kwargs):
        held_at_start.append(activations())
        return real_run_mode(*args, **kwargs)

    real_run_mode = timing.run_mode
    monkeypatch.setattr(timing, "run_mode", run_mode)
    result, _, _, index, _ = timing._first_that_fits(loaded, [[layout], [layout]], "torch_ref", **timing_args)
    assert index == 1 and result is not None and held_at_start == [before, before]
