"""`python -m ps_bridge.bench ARGS`: the same as `ps-bridge bench ARGS`."""

import sys

from ps_bridge.bench.run import main

sys.exit(main())
