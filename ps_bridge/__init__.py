"""ps-bridge: prefix-shared RL training of LLMs with verl + Megatron-core through Megatron-Bridge.

`ps_bridge.providers` and `ps_bridge.models` live in the checkout's top-level `providers/` and
`models/` folders; pyproject.toml maps them into this package, so run from a checkout through an
(editable) install: `pip install --no-deps -e .` (`make venv` does it).
"""

__version__ = "0.1.0"
