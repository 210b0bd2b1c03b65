"""`ps-bridge bench --smoke` runs end to end on a CPU; the full bench refuses a CPU clearly."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from ps_bridge.tools import bench
from ps_bridge.tools.bench import timing


def parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.slow
def test_bench_smoke_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--smoke", "--no-progress", "--json", str(out), "--backends", "auto,flash_atten_gpu", "--fp32-reference"]
    plot = None
    try:
        import matplotlib  # noqa: F401

        plot = tmp_path / "bench.png"
        argv += ["--plot", str(plot)]
    except ImportError:
        pass
    assert bench.run_bench(parse(argv)) == 0
    text = capsys.readouterr().out
    assert "tiny-qwen2.5: 2 of 2 layers" in text
    assert "tiny-qwen3.5: 4 of 4 layers" in text  # the Gated DeltaNet family runs too
    assert "ideal S" in text and "rel err sh vs fp32" in text
    data = json.loads(out.read_text())
    rows = data["rows"]
    # two smoke models x the smoke grid x two backends
    assert len(rows) == 2 * 2 * len(bench.SMOKE_GRID)
    assert {r["model"] for r in rows} == {"tiny-qwen2.5", "tiny-qwen3.5"}
    for r in rows:
        assert r["error"] is None
        P, R, n = r["P"], r["R"], r["n"]
        assert r["tokens_unshared"] == n * (P + R)
        assert r["tokens_shared"] == P + n * R
        assert r["ideal_speedup"] == pytest.approx(n * (P + R) / (P + n * R))
        assert r["actor_speedup"] > 0 and r["logprob_speedup"] > 0
        # the sharing rule has no host cost for the reference kernels on a CPU: it is not applied
        assert (r["rule"]["actor"], r["rule"]["logprob"]) == ("not applied", "not applied")
        # float32 on the CPU: the shared and unshared log-probs agree to rounding (bf16 on a GPU)
        assert r["max_logprob_diff"] < (1e-4 if not torch.cuda.is_available() else 0.1)
        # --fp32-reference: both runs against the float32 twin (on a CPU the runs are float32 already)
        for key in ("shared_rel_err_fp32", "unshared_rel_err_fp32", "shared_max_err_fp32", "unshared_max_err_fp32"):
            assert r[key] is not None and r[key] < (1e-5 if not torch.cuda.is_available() else 5e-2)
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def out_of_memory_above(max_unshared_samples):
    """A run_mode that raises CUDA's OOM for an unshared micro-batch of more samples than given
    (patched where the unshared run calls it, `bench.timing`)."""
    real_run_mode = timing.run_mode

    def run_mode(loaded, layouts, *args, **kwargs):
        for layout in layouts if isinstance(layouts, list) else [layouts]:
            unshared = layout.tokens_shared == layout.tokens_unshared
            if unshared and layout.num_samples > max_unshared_samples:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real_run_mode(loaded, layouts, *args, **kwargs)

    return run_mode


def test_bench_splits_an_unshared_batch_that_does_not_fit(monkeypatch, capsys):
    """An unshared batch too large for memory runs as consecutive micro-batches (gradient
    accumulation); its log-probs still line up sample by sample with the shared run's."""
    monkeypatch.setattr(timing, "run_mode", out_of_memory_above(2))
    argv = ["--smoke", "--no-progress", "--models", "tiny-qwen2.5", "--grid", "24,8,4", "--json", "-"]
    assert bench.run_bench(parse(argv)) == 0
    out = capsys.readouterr().out
    [row] = json.loads(out[out.index("{"):])["rows"]
    assert row["unshared"]["micro_batches"] == 2 and row["shared"]["micro_batches"] == 1
    assert not row["unshared_out_of_memory"] and row["unshared"]["tokens"] == 4 * (24 + 8)
    assert row["max_logprob_diff"] < 1e-4  # float32 on the CPU: same values, same order
    assert "ran as 2 unshared and 1 shared micro-batches" in out


def test_bench_reports_shared_alone_when_unshared_runs_out_of_memory(monkeypatch, capsys):
    """A row whose unshared batch does not fit even split is a result (OOM), not an error: the
    shared packing is still timed and reported."""
    monkeypatch.setattr(timing, "run_mode", out_of_memory_above(0))

    argv = ["--smoke", "--no-progress", "--models", "tiny-qwen2.5", "--grid", "24,8,4", "--json", "-"]
    assert bench.run_bench(parse(argv)) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("{"):])["rows"]
    assert len(rows) == 1 and rows[0]["unshared_out_of_memory"] and rows[0]["error"] is None
    assert rows[0]["shared"]["actor_ms"] > 0
    assert "| OOM |" in out and "the shared one was timed alone" in out
    assert rows[0]["unshared"]["micro_batches"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_bench_refuses_cpu_without_smoke(capsys):
    assert bench.run_bench(parse([])) == 2
    err = capsys.readouterr().err
    assert "needs an NVIDIA GPU" in err and "--smoke" in err


def test_bench_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        parse(["--grid", "1,2"])
    assert bench.run_bench(parse(["--smoke", "--models", "nope"])) == 2
    assert "unknown model shape" in capsys.readouterr().err
    assert bench.run_bench(parse(["--smoke", "--backends", "fast"])) == 2
    assert "unknown attention backend" in capsys.readouterr().err


def test_ideal_speedup_examples():
    assert bench.ideal_speedup(2048, 512, 8) == pytest.approx(3.333, abs=1e-3)
    assert bench.ideal_speedup(512, 4096, 8) == pytest.approx(8 * 4608 / (512 + 8 * 4096))


def test_bench_tree_rows_report_trie_tokens_and_flop_ratio(capsys):
    """`--trees system,chain,search` (tiny sizes under --smoke): each row is shared as a token trie
    and reports its trie tokens, S, F (bench/flops.py on the layouts it timed), x / S and x / F;
    float32 on the CPU, its log-probs equal the unshared run's."""
    from ps_bridge.tools.bench.flops import flop_shape, layout_flop_ratio
    from ps_bridge.layout import build_layout

    argv = ["--smoke", "--no-progress", "--models", "tiny-qwen2.5", "--trees", "system,chain,search", "--json", "-"]
    assert bench.run_bench(parse(argv)) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("{"):])["rows"]
    assert [r["tree"] for r in rows] == ["system", "chain", "search"]  # no grid rows without --grid
    assert "x/F" in out and "| system |" in out
    vocab = bench.MODEL_SHAPES["tiny-qwen2.5"].dims["vocab_size"]
    shape = flop_shape(bench.MODEL_SHAPES["tiny-qwen2.5"])
    for r, depth in zip(rows, (2, 1, 3)):
        assert r["error"] is None and r["tree_depth"] == depth
        samples = bench.TREE_SHAPES[r["tree"]].samples(vocab, 1234, smoke=True)
        trie = build_layout(samples, share="tree", prompt_values=False)
        unshared = build_layout(samples, share=False)
        assert r["tokens_shared"] == trie.tokens_shared < r["tokens_unshared"] == unshared.tokens_unshared
        assert r["nodes"] == trie.num_segments
        assert r["ideal_speedup"] == pytest.approx(unshared.tokens_unshared / trie.tokens_shared)
        assert r["flop_ratio"] == pytest.approx(layout_flop_ratio(shape, trie, unshared)) and r["flop_ratio"] > 1
        assert r["max_logprob_diff"] < 1e-4


def test_bench_rejects_unknown_tree_shapes(capsys):
    assert bench.run_bench(parse(["--smoke", "--trees", "forest"])) == 2
    assert "unknown tree shape 'forest'" in capsys.readouterr().err
