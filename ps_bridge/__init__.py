"""ps-bridge: prefix-shared RL training of LLMs with verl + Megatron-core through Megatron-Bridge."""

import os as _os

__version__ = "0.1.0"

# pyproject maps the top-level `providers/` and `models/` folders to `ps_bridge.providers` and
# `ps_bridge.models`. When the package is used from a source checkout without being installed
# (PYTHONPATH=checkout, e.g. on a GPU machine or under torchrun), resolve them the same way.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "providers", "registry.py")) and _checkout not in __path__:
    __path__.append(_checkout)
