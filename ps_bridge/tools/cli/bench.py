"""`ps-bridge bench`: the GPU benchmark (`ps_bridge.tools.bench`) as a subcommand."""

from __future__ import annotations


def add_parser(sub) -> None:
    # imported here: torch is heavy
    from ps_bridge.tools.bench import add_bench_arguments, run_bench

    bp = sub.add_parser("bench", help="GPU benchmark: prefix-shared vs unshared actor step and log-prob pass")
    add_bench_arguments(bp)
    bp.set_defaults(func=run_bench)
