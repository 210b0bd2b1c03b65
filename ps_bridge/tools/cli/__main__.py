"""`python -m ps_bridge.tools.cli ...` (also under torchrun): the same as the `ps-bridge` console script."""

import sys

from ps_bridge.tools.cli import main

sys.exit(main())
