"""Prefix-aware Megatron modules and layer specs (importable as `ps_bridge.models`)."""
