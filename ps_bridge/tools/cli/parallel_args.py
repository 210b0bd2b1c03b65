"""Command-line options of the parallel settings, for the commands run under torchrun."""

from __future__ import annotations

from ps_bridge.parallel.settings import ParallelSettings


def add_parallel_arguments(parser) -> None:
    """`--tp`, `--pp`, `--sp`, `--cp` for a command that runs under `torchrun --nproc-per-node N`."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (physical stages)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (head-parallel over contiguous shards)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE; out of the data-parallel ranks)")


def settings_from_args(args) -> ParallelSettings:
    return ParallelSettings(tp=args.tp, pp=args.pp, cp=args.cp, sequence_parallel=args.sp, ep=args.ep)
