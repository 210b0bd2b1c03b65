"""`python -m ps_bridge.bench ARGS` is `ps-bridge bench ARGS` (same quiet output and errors)."""

import sys

from ps_bridge.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
