#!/usr/bin/env python3
"""Fit the sharing rule's constants (`ps_bridge/launch_rule.py`: `TFLOPS`, `HOST_NS`) to `ps-bridge bench`
rows of the small shapes, and show what the rule would decide with them on each row.

    python3 tools/fit_sharing_rule.py bench-small.json [more.json ...] [--min-gpu-tokens 12288]

The rows: one attention-only model (Qwen2.5) and one with Gated DeltaNet layers (Qwen3.5) at their full
layer count, a few (P, R) each, as `tools/gpu_small_shapes.sh` (`STEPS=small`) runs them. The fit:

- `TFLOPS[kind, backward]`: the unshared step's throughput, `F * T_unshared * (layer_weights + hidden *
  vocab) / time` (F = 6 with the backward, 2 without), averaged over the GPU-bound unshared rows (at least
  `--min-gpu-tokens` tokens), rounded down to a multiple of 5.
- `HOST_NS`: the shared step's time per layer over its host-bound rows: those whose shared GPU work at
  that throughput is less than half the measured time. An attention-only model gives the attention
  layer's cost (time / layers); a model with GDN layers gives the GDN layer's, its attention layers
  priced at that cost: (time - attention_layers * HOST_NS[attention]) / gdn_layers. Rounded to 50 us.

Then each row's measured speed-up beside the rule's decision with launch_rule's constants and with the fit
(`MARGIN` as in launch_rule), and how many passes each would run on the slower path: a fit replaces the
constants only where it decides better.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from statistics import mean
from typing import Dict, List, Tuple

PASSES = (("actor", True), ("logprob", False))  # bench field, backward


@dataclass(frozen=True)
class Row:
    """One bench row's numbers the fit reads, its model's costs resolved (`launch_rule.ModelCost`)."""

    name: str
    cost: object  # ModelCost
    tokens_unshared: int
    tokens_shared: int
    outputs_shared: int  # positions the shared output layer runs on: one per group, plus the responses
    ms: Dict[Tuple[str, bool], float]  # (unshared|shared, backward) -> step milliseconds

    @property
    def kind(self) -> str:
        return "gdn" if self.cost.gdn_layers else "attention"

    def flops(self, shared: bool, backward: bool) -> int:
        """The FLOPs the rule counts for one packing's pass (`ModelCost.pass_flops`)."""
        if shared:
            return self.cost.pass_flops(self.tokens_shared, self.outputs_shared, backward)
        return self.cost.pass_flops(self.tokens_unshared, self.tokens_unshared, backward)


def read_rows(paths: List[str]) -> List[Row]:
    # imported here: the bench catalog imports torch
    from ps_bridge.launch_rule import ModelCost
    from ps_bridge.tools.bench.catalog import FAMILIES, MODEL_SHAPES

    rows = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for r in doc["rows"]:
            if r.get("error") or r.get("tree") or not r.get("unshared") or not r.get("shared"):
                continue
            shape = MODEL_SHAPES[r["model"]]
            cost = ModelCost.from_hf_config(FAMILIES[shape.family](shape.dims, r["layers"]))
            ms = {(side, backward): float(r[side][f"{what}_ms"]) for side in ("unshared", "shared")
                  for what, backward in PASSES}
            rows.append(Row(f"{r['model']} ({r['P']}, {r['R']}, {r['n']}) x {r['groups']}", cost, int(r["tokens_unshared"]),
                            int(r["tokens_shared"]), r["groups"] + r["groups"] * r["n"] * r["R"], ms))
    return rows


def fit(rows: List[Row], min_gpu_tokens: int = 12288):
    """(TFLOPS, HOST_NS, host-bound rows by (kind, backward)) in launch_rule's keys and units."""
    tflops: Dict[Tuple[str, bool], int] = {}
    for kind in ("attention", "gdn"):
        for _, backward in PASSES:
            rates = [r.flops(False, backward) / (r.ms["unshared", backward] * 1e9) for r in rows
                     if r.kind == kind and r.tokens_unshared >= min_gpu_tokens]
            if rates:
                tflops[kind, backward] = int(mean(rates)) // 5 * 5
    host: Dict[Tuple[str, bool], int] = {}
    bound: Dict[Tuple[str, bool], List[str]] = {}
    for kind in ("attention", "gdn"):  # attention first: the GDN fit prices its attention layers
        for _, backward in PASSES:
            if (kind, backward) not in tflops:
                continue
            per_layer, names = [], []
            for r in rows:
                ms = r.ms["shared", backward]
                if r.kind != kind or r.flops(True, backward) / (tflops[kind, backward] * 1e9) >= ms / 2:
                    continue
                if kind == "gdn":
                    if ("attention", backward) not in host:
                        raise SystemExit("a model with GDN layers needs an attention-only model's rows to price "
                                         "its attention layers (add a Qwen2.5 row)")
                    ms -= r.cost.attention_layers * host["attention", backward] / 1e6
                    per_layer.append(ms / r.cost.gdn_layers)
                else:
                    per_layer.append(ms / r.cost.attention_layers)
                names.append(r.name)
            if per_layer:
                host[kind, backward] = round(mean(per_layer) * 20) * 50_000
                bound[kind, backward] = names
    return tflops, host, bound


def decide(row: Row, backward: bool, tflops=None, host=None) -> str:
    """The rule's decision for `row` as one micro-batch (`launch_rule.eager_decision`, backends `auto` on a
    CUDA device in bf16) with a fit's constants, or launch_rule's where None."""
    # imported here: see read_rows
    from ps_bridge.launch_rule import MicroBatchCounts, concrete_backends, eager_decision

    if tflops is not None and (row.kind, backward) not in tflops:
        return "no fit"
    attention, gdn = concrete_backends("auto", "auto", "cuda", "bfloat16", row.cost.head_dim)
    host_ns = None if host is None else {
        (kind, attention if kind == "attention" else gdn, "cuda", b): v for (kind, b), v in host.items()}
    counts = MicroBatchCounts(samples=0, groups=0, tokens_unshared=row.tokens_unshared,
                              tokens_shared=row.tokens_shared, outputs_shared=row.outputs_shared)
    decision = eager_decision(counts, row.cost, attention, gdn, "cuda", "bfloat16", backward, tflops=tflops,
                              host_ns=host_ns)
    if not decision.priced:
        return "no fit"
    return "shared" if decision.share else "unshared"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", nargs="+")
    parser.add_argument("--min-gpu-tokens", type=int, default=12288,
                        help="unshared rows of at least this many tokens are GPU-bound (the TFLOPS fit)")
    args = parser.parse_args(argv)
    rows = read_rows(args.bench_json)
    if not rows:
        print("no one-level rows with both packings timed in", ", ".join(args.bench_json), file=sys.stderr)
        return 1
    tflops, host, bound = fit(rows, args.min_gpu_tokens)
    print("TFLOPS = {")
    for (kind, backward), v in sorted(tflops.items()):
        print(f"    ({kind!r}, {backward}): {v},")
    print("}\nHOST_NS = {  # per layer, the shared step's host time where host-bound")
    for (kind, backward), v in sorted(host.items()):
        print(f"    ({kind!r}, {'flash_atten_gpu' if kind == 'attention' else 'fla'!r}, 'cuda', {backward}): {v:_},"
              f"  # {'; '.join(bound[kind, backward])}")
    print("}\n\nrow | pass | speed-up shared / unshared | rule with launch_rule's constants | right "
          "| rule with this fit | right")
    wrong = {"launch_rule": 0, "fit": 0}
    for r in rows:
        for what, backward in PASSES:
            speedup = r.ms["unshared", backward] / r.ms["shared", backward]
            cells = []
            for name, tables in (("launch_rule", (None, None)), ("fit", (tflops, host))):
                choice = decide(r, backward, *tables)
                right = "-" if choice == "no fit" else "yes" if (choice == "shared") == (speedup >= 1) else "no"
                wrong[name] += right == "no"
                cells += [choice, right]
            print(f"{r.name} | {what} | {speedup:.2f}x | " + " | ".join(cells))
    print(f"\npasses where the rule runs the slower path: launch_rule's constants {wrong['launch_rule']}, "
          f"this fit {wrong['fit']}, of {2 * len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
