"""`ps-bridge verl-check` over a grid of (model, P, R) in one process, against our engine with sharing off.

    PS_BRIDGE_SHARING=auto python3 tools/verl_check_grid.py --runs qwen3.5-0.8b:128:32,qwen2.5-0.5b:128:32 --json OUT.json

Sharing on vs sharing off: verl-check's second engine is `PrefixSharedMegatronEngine`
with the sharing rule (`PS_BRIDGE_SHARING`, default auto); its first is verl's stock engine for
Qwen2.5 (Megatron-Bridge's stock provider, a different model implementation) and our engine with
sharing disabled for Qwen3.5. This script makes the first engine our engine with sharing disabled for
every family (verl-check's `--baseline off`, the default here; `stock` keeps verl-check's default), so both engines run
the same model code and the ratio is sharing on / sharing off alone. Everything else is verl-check's:
the small-shape settings (8 prompts x n = 8, 3 steps, bf16, `ppo_mini_batch_size=4`, 24 layers) unless
given. Runs share one process (imports and CUDA set-up once); the JSON is rewritten after each run,
with, per run, verl-check's document and how many micro-batches the rule ran shared, by pass
(`fwd+bwd`: the update; `fwd`: old and ref log-probs), all steps, as they were packed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help="model:P:R,model:P:R,... (catalogue shapes)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--baseline", choices=("off", "stock"), default="off")
    parser.add_argument("--baseline-graphs", choices=("on", "off"), default=None,
                        help="the sharing-off engine's CUDA graphs (default: PS_BRIDGE_CUDA_GRAPHS)")
    parser.add_argument("--shared-first", action="store_true", help="run the shared engine before the baseline")
    parser.add_argument("--interleave", action="store_true", help="both engines resident, steps in turns (A B, B A, ...)")
    parser.add_argument("--workdir", default="/tmp/verl-check")
    parser.add_argument("--json", required=True)
    parser.add_argument("overrides", nargs="*", default=["actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    args = parser.parse_args()

    from ps_bridge.tools.cli.verl_check import _prepare_process

    _prepare_process()  # before verl's engine is imported
    import torch

    from ps_bridge.tools import verl_check as check
    from ps_bridge.verl import engine as engine_module

    decisions = []
    layout_of = engine_module.micro_batch_layout  # the engine's forward step decides and packs through it

    def counted(samples, config, *a, **kw):
        layout, decision = layout_of(samples, config, *a, **kw)
        # what ran: the final packing (after the rule's fallbacks), shared or not
        decisions.append((config.enabled, torch.is_grad_enabled(), layout.has_sharing))
        return layout, decision

    engine_module.micro_batch_layout = counted
    results = []
    for spec in args.runs.split(","):
        model, P, R = spec.split(":")
        settings = check.CheckSettings(
            model=model, layers=args.layers, prompts=args.prompts, n=args.n, prompt_len=int(P),
            response_len=int(R), steps=args.steps, dtype=args.dtype, overrides=list(args.overrides),
            workdir=args.workdir, baseline=args.baseline, shared_first=args.shared_first,
            baseline_graphs=None if args.baseline_graphs is None else args.baseline_graphs == "on",
            interleave=args.interleave)
        decisions.clear()
        t0 = time.perf_counter()
        try:
            doc = check.run_check(settings)
        except Exception as e:  # noqa: BLE001 - one failed run must not lose the others
            print(f"== {spec}: failed: {type(e).__name__}: {e}", flush=True)
            results.append({"run": spec, "error": f"{type(e).__name__}: {e}"})
            continue
        counts = Counter(("fwd+bwd" if grad else "fwd", "shared" if share else "unshared")
                         for enabled, grad, share in decisions if enabled)
        doc["rule_micro_batches"] = {f"{p} {s}": c for (p, s), c in sorted(counts.items())}
        doc["seconds"] = time.perf_counter() - t0
        doc["sharing_mode"] = os.environ.get("PS_BRIDGE_SHARING", "auto")
        doc["cuda_graph_buckets"] = os.environ.get("PS_BRIDGE_CUDA_GRAPH_BUCKETS", "segment")
        print(f"== {spec} ({doc['seconds']:.0f} s) micro-batches by the rule: {doc['rule_micro_batches']}", flush=True)
        print(check.format_report(doc), flush=True)
        results.append({"run": spec, "doc": doc})
        with open(args.json + ".tmp", "w") as f:
            json.dump(results, f, indent=1, default=lambda o: None if o != o else str(o))
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
