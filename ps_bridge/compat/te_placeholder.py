"""Import `megatron.bridge` where Transformer Engine (TE) is not installed.

`megatron.bridge` hard-imports `transformer_engine.pytorch` (its LoRA layers) although nothing on
our path uses TE. megatron-core, on the other hand, probes for TE once at import and caches
`HAVE_TE`. So: let megatron-core probe first (it sees no TE and takes its local modules), then put a
placeholder `transformer_engine` in `sys.modules` for the duration of the `megatron.bridge` import,
and remove it again so later `import transformer_engine` probes (verl, peft, our backends) still see
that TE is absent. Where TE is installed this does nothing.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

_PLACEHOLDER_NAMES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")


class _Anything:
    """Stands in for any TE class or function referenced at import time; fails if actually used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str):
        if _is_dunder(item):  # introspection (inspect, copy, pickle) must see a plain absence
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} is part of Transformer Engine, which is not installed; "
            "ps-bridge only stubs it so that megatron.bridge can be imported."
        )

    def __mro_entries__(self, bases):
        return (object,)


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _module_getattr(module_name: str):
    def __getattr__(item: str):
        # `inspect.getmodule` (run by torch.library when torchvision registers ops during the
        # megatron.bridge import) reads `__file__` of every module in sys.modules
        if _is_dunder(item):
            raise AttributeError(item)
        return _Anything(f"{module_name}.{item}")

    return __getattr__


def _make_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []  # a package, so that submodule imports resolve to our placeholders
    module.__getattr__ = _module_getattr(name)  # type: ignore[attr-defined]
    module.__ps_bridge_placeholder__ = True
    return module


def transformer_engine_installed() -> bool:
    existing = sys.modules.get("transformer_engine")
    if existing is not None:
        return not getattr(existing, "__ps_bridge_placeholder__", False)
    return importlib.util.find_spec("transformer_engine") is not None


def import_megatron_bridge():
    """Import and return `megatron.bridge`, with a temporary TE placeholder if TE is absent."""
    if "megatron.bridge" in sys.modules or transformer_engine_installed():
        # imported here: megatron-core is heavy
        import megatron.bridge

        return megatron.bridge

    # imported here: this function's purpose (megatron-core caches HAVE_TE=False before the placeholder)
    import megatron.core  # noqa: F401
    import megatron.core.extensions.transformer_engine  # noqa: F401  (its own TE probe)
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.models.hybrid.hybrid_layer_specs  # noqa: F401  (builds specs at import)

    added = []
    for name in _PLACEHOLDER_NAMES:
        if name not in sys.modules:
            sys.modules[name] = _make_module(name)
            added.append(name)
    try:
        # imported here: megatron-core is heavy
        import megatron.bridge
    finally:
        for name in added:
            sys.modules.pop(name, None)
    return megatron.bridge
