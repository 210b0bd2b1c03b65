"""Megatron-Bridge providers and bridges for prefix-aware models (importable as `ps_bridge.providers`).

Nothing is registered with Megatron-Bridge at import time: call `register_all()` (the CLI and the
verl plugin do) so that `AutoBridge.from_hf_pretrained` returns our providers from then on.
"""

from ps_bridge.providers.registry import get_provider_entry, provider_names, register_all, resolve_provider

__all__ = ["get_provider_entry", "provider_names", "register_all", "resolve_provider"]
