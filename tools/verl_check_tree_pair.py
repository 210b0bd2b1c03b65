"""verl's trainer step on ps-bridge's engine with prefix trees (the default) against one level
(`--no-tree`), both engines resident, their steps in turns.

    python3 tools/verl_check_tree_pair.py --json OUT.json [verl-check arguments...]

The arguments are `ps-bridge verl-check`'s (`--model qwen2.5-7b --layers 4 --prompts 32 ... key=value`).
Both engines are verl-check's prefix-shared engine on the same checkpoint and the same data, one packing
prefix trees and one identical prompts only, held at once and stepped A B, B A, A B, ... (verl-check's
`--interleave`: neither gains from running second). The JSON is a verl-check document with "no_tree"
in place of stock and "tree" in place of shared: per phase, x = one-level time / tree time over the
steps after the first, and the log-prob, loss and gradient-norm differences between the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main() -> int:
    outer = argparse.ArgumentParser(add_help=False)
    outer.add_argument("--json", required=True)
    args, rest = outer.parse_known_args()

    from ps_bridge.tools.cli import build_parser
    from ps_bridge.tools.cli.verl_check import _prepare_process

    check_args = build_parser().parse_args(["verl-check", *rest])
    if check_args.tree is False or not check_args.model:
        print("give verl-check's --model and settings, without --no-tree (both packings run)", file=sys.stderr)
        return 2
    _prepare_process()  # before verl's engine is imported
    from ps_bridge.tools import verl_check as check
    from ps_bridge.tools.verl_check.compare import compare, speedups
    from ps_bridge.tools.verl_check.data import ideal_ratio
    from ps_bridge.tools.verl_check.flops import flop_ratios
    from ps_bridge.tools.verl_check.model import checkpoint_for
    from ps_bridge.tools.verl_check.run import kind_steps, synthetic_batches

    settings = check.CheckSettings(
        model=check_args.model, layers=check_args.layers, prompts=check_args.prompts, n=check_args.n,
        prompt_len=check_args.prompt_len, system_prompt_len=check_args.system_prompt_len,
        response_len=check_args.response_len, steps=check_args.steps, dtype=check_args.dtype, seed=check_args.seed,
        overrides=list(check_args.overrides), workdir=check_args.workdir or "/tmp/verl-check", interleave=True)
    cfg = check.trainer_config(settings)
    ckpt = checkpoint_for(settings, settings.workdir)
    batches, lengths = synthetic_batches(settings, cfg, ckpt)
    names = ("no_tree", "tree")
    kinds = {"tree": dataclasses.replace(settings, tree=True), "no_tree": dataclasses.replace(settings, tree=False)}
    say = (lambda message: None) if check_args.no_progress else (lambda message: print(message, flush=True))
    gens = {name: kind_steps("shared", kinds[name], ckpt, cfg, batches, say) for name in names}
    runs = {name: [] for name in names}
    try:
        for t in range(len(batches)):
            for name in (names if t % 2 == 0 else names[::-1]):
                runs[name].append(next(gens[name]))
    finally:
        for g in gens.values():
            g.close()
    steps = compare(runs["no_tree"], runs["tree"], names)
    config = {
        "model": settings.model, "checkpoint": ckpt, "layers": settings.layers, "prompts": settings.prompts,
        "n": settings.n, "prompt_len": settings.prompt_len, "system_prompt_len": settings.system_prompt_len,
        "response_len_mean": settings.response_len, "steps": settings.steps, "dtype": settings.dtype,
        "seed": settings.seed, "overrides": list(settings.overrides), "engine_order": ["interleaved", *names],
        "ideal_speedup_S": ideal_ratio(settings, lengths),
        "speedup": speedups(steps, names), "speedup_median": speedups(steps, names, statistic="median"),
        "flop_ratio_F": {name: flop_ratios(steps, name) for name in names},
    }
    doc = {"what": "ps-bridge's engine, one level (no_tree) against prefix trees (tree); x = no_tree time / tree time",
           "config": config, "steps": steps}
    check.write_json(doc, args.json)
    for t, s in enumerate(steps):
        print(f"step {t + 1}: seconds " + ", ".join(
            f"{phase} {s['phase_seconds']['no_tree'][phase]:.2f}/{s['phase_seconds']['tree'][phase]:.2f}"
            for phase in check.PHASES) + f" (one level / trees); old log-prob max |diff| {s['logprob_max_abs_diff']:.2e}")
    print("one level / trees, steps after the first: "
          + ", ".join(f"{phase} {config['speedup'][phase]:.3f}x" for phase in check.PHASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
