"""`python -m ps_bridge.cli ...` (also under torchrun): the same as the `ps-bridge` console script."""

import sys

from ps_bridge.cli import main

sys.exit(main())
