"""`python -m ps_bridge.tools.grpo`: see `ps_bridge.tools.grpo.harness`."""

import sys

from ps_bridge.tools.grpo.harness import main

if __name__ == "__main__":
    sys.exit(main())
