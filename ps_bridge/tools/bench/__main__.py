"""`python -m ps_bridge.tools.bench ARGS` is `ps-bridge bench ARGS` (same quiet output and errors)."""

import sys

from ps_bridge.tools.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
