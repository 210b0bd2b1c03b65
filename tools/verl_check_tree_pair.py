"""`ps-bridge verl-check` with prefix trees (the default) and with one level (`--no-tree`) in one process,
against one run of the stock engine.

    python3 tools/verl_check_tree_pair.py --json OUT.json [verl-check arguments...]

The arguments are verl-check's (`--model qwen2.5-7b --layers 4 --prompts 32 ... key=value ...`). The
stock engine runs once; the prefix-shared engine runs twice on the same checkpoint and the same data,
trees first (whatever the process warms up as it goes then favours the one-level run), each compared
with that stock run as verl-check compares them. The JSON holds both verl-check documents, under
"tree" and "no_tree", rewritten after each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
    from ps_bridge.tools.verl_check import run as run_module

    settings = check.CheckSettings(
        model=check_args.model, layers=check_args.layers, prompts=check_args.prompts, n=check_args.n,
        prompt_len=check_args.prompt_len, system_prompt_len=check_args.system_prompt_len,
        response_len=check_args.response_len, steps=check_args.steps, dtype=check_args.dtype, seed=check_args.seed,
        overrides=list(check_args.overrides), workdir=check_args.workdir or "/tmp/verl-check")
    stock_runs = {}
    run_kind = run_module.run_kind

    def stock_once(kind, *a, **kw):  # the same checkpoint, data and settings: one stock run serves both
        if kind != "stock":
            return run_kind(kind, *a, **kw)
        if kind not in stock_runs:
            stock_runs[kind] = run_kind(kind, *a, **kw)
        return stock_runs[kind]

    run_module.run_kind = stock_once
    out = {}
    for name, tree in (("tree", None), ("no_tree", False)):
        doc = check.run_check(dataclasses.replace(settings, tree=tree))
        out[name] = doc
        print(f"== {name}", flush=True)
        print(check.format_report(doc), flush=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    for phase in check.PHASES:
        a, b = out["tree"]["config"]["speedup"][phase], out["no_tree"]["config"]["speedup"][phase]
        print(f"{phase}: trees {a:.2f}x, one level {b:.2f}x against stock; trees / one level {a / b:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
