"""`ps-bridge bench --min-shared-sweep` (the measurement that chooses `layout.DEFAULT_MIN_SHARED`) on
a CPU: its rows exist, the two packings it times are the token trie at `min_shared=0` (the template
shared: one more level) and at `min_shared=K+1` (the template in every prompt), counted node by node,
and both give the same log-probs; its refusals."""

from __future__ import annotations

import argparse
import json

import pytest

from ps_bridge.tools import bench
from ps_bridge.tools.bench import catalog
from ps_bridge.tools.bench import run as bench_run


def parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    return parser.parse_args(argv)


def test_template_samples_share_only_the_template():
    from ps_bridge.layout import build_layout

    G, P, K, n, R = 3, 24, 5, 2, 4
    samples = catalog.template_samples(256, 7, G, P, K, n, R)
    assert len(samples) == G * n and all(len(s.prompt) == P and len(s.response) == R for s in samples)
    shared = build_layout(samples, share="tree", min_shared=0)
    # the template, each prompt's own part, every response
    assert (shared.num_segments, shared.tree_depth, shared.tokens_shared) == (1 + G + G * n, 2, K + G * (P - K) + G * n * R)
    unshared = build_layout(samples, share="tree", min_shared=K + 1)
    assert (unshared.num_segments, unshared.tree_depth, unshared.tokens_shared) == (G + G * n, 1, G * P + G * n * R)
    with pytest.raises(ValueError, match="shorter than the prompt"):
        catalog.template_samples(256, 7, G, P, P, n, R)


def test_min_shared_sweep_rows_time_both_thresholds(capsys, monkeypatch):
    G, P, R, n = 3, 24, 4, 2
    timed = []
    real = bench_run.run_pair

    def counted(loaded, first, second, *args, **kwargs):  # the layouts the sweep times
        timed.append([(x.num_segments, x.tree_depth, x.tokens_shared) for x in (first, second)])
        return real(loaded, first, second, *args, **kwargs)

    monkeypatch.setattr(bench_run, "run_pair", counted)
    argv = ["--smoke", "--no-progress", "--models", "tiny-qwen2.5", "--grid", f"{P},{R},{n}", "--groups", str(G),
            "--min-shared-sweep", "4,8", "--json", "-"]
    assert bench.run_bench(parse(argv)) == 0
    out = capsys.readouterr().out
    doc = json.loads(out[out.index("{"):])
    assert doc["rows"] == [] and "run k" in out and "min_shared = K + 1" in out
    rows = doc["min_shared_rows"]
    assert [r["run"] for r in rows] == [4, 8]
    for r, seen in zip(rows, timed):
        K = r["run"]
        assert r["error"] is None and (r["P"], r["R"], r["n"], r["groups"]) == (P, R, n, G)
        shared = (1 + G + G * n, 2, K + G * (P - K) + G * n * R)
        not_shared = (G + G * n, 1, G * P + G * n * R)
        assert seen == [shared, not_shared]
        assert (r["nodes_shared_run"], r["depth_shared_run"], r["tokens_shared_run"]) == shared
        assert (r["nodes_unshared_run"], r["depth_unshared_run"], r["tokens_unshared_run"]) == not_shared
        assert r["actor_x"] > 0 and r["logprob_x"] > 0
        assert r["shared_run"]["actor_ms"] > 0 and r["unshared_run"]["logprob_ms"] > 0
        assert r["max_logprob_diff"] < 1e-4  # float32 on the CPU: both packings are exact


def test_min_shared_sweep_refusals(capsys):
    def error(argv):
        assert bench.run_bench(parse(["--smoke", "--models", "tiny-qwen2.5"] + argv)) == 2
        return capsys.readouterr().err

    assert "--groups 1 gives one prompt" in error(["--min-shared-sweep", "4"])
    assert "needs prompts of more than 16 tokens (grid row P=16)" in error(
        ["--min-shared-sweep", "8", "--grid", "16,4,2", "--groups", "2"])
    assert "drop --trees" in error(["--min-shared-sweep", "--trees", "system", "--groups", "2"])
    with pytest.raises(SystemExit):
        parse(["--min-shared-sweep", "4,x"])
    with pytest.raises(SystemExit):
        parse(["--min-shared-sweep", "0"])
