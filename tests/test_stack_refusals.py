"""Features a stack cannot run exactly are refused there, naming the version and the fix
(ps_bridge/compat/: one adapter per dependency says what differs)."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from ps_bridge.compat import megatron_bridge as compat_megatron_bridge

pytestmark = pytest.mark.core


def test_vl_refusal_names_version_and_fix(monkeypatch):
    monkeypatch.setattr(compat_megatron_bridge, "installed_version", lambda: "0.5.0")
    message = compat_megatron_bridge.vl_refusal()
    assert "Megatron-Bridge 0.5.0" in message and "megatron-bridge>=0.6.0" in message
    monkeypatch.setattr(compat_megatron_bridge, "installed_version", lambda: "0.6.2")
    assert compat_megatron_bridge.vl_refusal() is None


def test_vl_model_is_refused_or_built_by_the_installed_bridge(tmp_path):
    """On Megatron-Bridge 0.5.x loading a Qwen3.5 VL checkpoint stops with the refusal; from 0.6.0 on
    it builds (its exactness is tests/test_qwen35_model.py's)."""
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen35_vl

    build_tiny_qwen35_vl(str(tmp_path))
    config = PrefixSharingConfig(enabled=True, backend="torch_ref", gdn_backend="torch_ref")
    if Version(compat_megatron_bridge.installed_version()) < Version(compat_megatron_bridge.VL_SINCE):
        with pytest.raises(RuntimeError, match="refused on Megatron-Bridge"):
            load_model(str(tmp_path), config, dtype=torch.float32)
    else:
        assert load_model(str(tmp_path), config, dtype=torch.float32).model is not None
