"""`ps-bridge`: check prefix sharing on a checkpoint (`logprobs`), run the main job (`demo`),
measure the speed-up on a GPU (`bench`), check the environment (`doctor`).

Errors a user can fix (missing file, bad JSON, bad token ids, unsupported architecture, unknown
backend) exit with status 2 and one line `ps-bridge: error: ...` on stderr. Third-party import
notices are silenced unless `-v` is given (`ps_bridge.compat.quiet`).

One module per command (`logprobs`, `demo`, `bench`, `verl_check`, `export`, `doctor`), each with
`add_parser(subparsers)`. `ps-bridge doctor` builds a parser with only its own command: the others'
arguments import torch and the Megatron stack, whose absence or breakage doctor is there to report.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Sequence

from ps_bridge.compat.quiet import quiet_third_party
from ps_bridge.tools.cli import bench, demo, doctor, export, logprobs, verl_check
from ps_bridge.tools.cli.errors import UsageError

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

__all__ = ["UsageError", "build_parser", "main"]

VERBOSE_FLAGS = ("-v", "--verbose")


def build_parser(only_doctor: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ps-bridge", description=__doc__.split("\n\n")[0])
    parser.add_argument(*VERBOSE_FLAGS, action="store_true",
                        help="show the [PS] log lines and third-party notices")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (doctor,) if only_doctor else (logprobs, demo, bench, verl_check, export, doctor):
        command.add_parser(sub)
    return parser


def command_name(argv: Sequence[str]) -> str | None:
    """The command: the first argument that is not an option (the top-level options take no value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def verbose_requested(argv: Sequence[str]) -> bool:
    """`-v` among the options before the command: known before the parser (whose building imports
    the heavy stack) exists."""
    for arg in argv:
        if not arg.startswith("-"):
            return False
        if arg in VERBOSE_FLAGS:
            return True
    return False


def setup_logging(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    logging.getLogger("ps_bridge").setLevel(level)  # our [PS] lines are INFO; our warnings always show


def main(argv: List[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_third_party(verbose_requested(argv))
    args = build_parser(only_doctor=command_name(argv) == "doctor").parse_args(argv)
    setup_logging(args.verbose)
    try:
        code = int(args.func(args) or 0)
    except UsageError as e:
        print(f"ps-bridge: error: {e}", file=sys.stderr)
        return 2
    groups = sys.modules.get("ps_bridge.parallel.groups")  # absent where no command built groups (doctor)
    if groups is not None:
        groups.close_parallel()
    return code
