"""Qwen3.5 setup checks: registry names, the fla-on-Hopper guard at model build, MTP handling."""

import logging
import types

import pytest
import torch

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.kernels.gdn import check_gdn_backend_usable, fla as fla_backend
from ps_bridge.providers.registry import get_provider_entry, resolve_provider


def qwen35_module():
    """ps_bridge.providers.qwen35, imported the supported way (megatron.bridge without TE)."""
    return get_provider_entry("qwen3.5").load()


@pytest.mark.parametrize(
    "arch, name",
    [
        ("Qwen3_5ForCausalLM", "qwen3.5"),
        ("Qwen3_5ForConditionalGeneration", "qwen3.5"),
        ("Qwen3_5MoeForCausalLM", "qwen3.5-moe"),
        ("Qwen3_5MoeForConditionalGeneration", "qwen3.5-moe"),
    ],
)
def test_registry_resolves_all_four_architectures(arch, name):
    assert resolve_provider(None, [arch]).name == name
    assert PrefixSharingConfig(provider=name, gdn_backend="torch_ref").provider == name


def fake_gpu(monkeypatch, capability=(9, 0), triton_version="3.6.0", tilelang=False):
    import importlib.util

    import triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(triton, "__version__", triton_version)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: types.SimpleNamespace() if (name == "tilelang" and tilelang) else
        (None if name == "tilelang" else real_find_spec(name, *a)),
    )


def test_fla_backward_refused_on_hopper_with_old_triton(monkeypatch):
    fake_gpu(monkeypatch)
    with pytest.raises(RuntimeError) as err:
        check_gdn_backend_usable("auto", torch.device("cuda", 0))
    assert "Triton to >= 3.7.1" in str(err.value) and "pip install tilelang" in str(err.value)


@pytest.mark.parametrize("kw", [dict(triton_version="3.7.1"), dict(capability=(8, 0)), dict(triton_version="3.3.1")])
def test_fla_backward_allowed_otherwise(monkeypatch, kw):
    fake_gpu(monkeypatch, **kw)
    assert fla_backend.hopper_backward_problem(torch.device("cuda", 0)) is None
    check_gdn_backend_usable("fla", torch.device("cuda", 0))
    # torch_ref never needs fla
    check_gdn_backend_usable("torch_ref", torch.device("cuda", 0))


@pytest.mark.parametrize("fla_version, allowed", [("0.6.0", True), ("0.4.2", False)])
def test_tilelang_allows_the_hopper_backward_only_from_fla_0_6(monkeypatch, fla_version, allowed):
    """With tilelang installed fla-core 0.6.0+ runs the Triton-sensitive kernel with tilelang
    (compat/fla.py `tilelang_backward_route`); fla-core before 0.6.0 has no such route, so the refusal
    stays and names the fla-core it needs (both cases on every stack: the version is faked)."""
    import importlib.metadata

    fake_gpu(monkeypatch, tilelang=True)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: fla_version if name == "fla-core" else real_version(name))
    problem = fla_backend.hopper_backward_problem(torch.device("cuda", 0))
    if allowed:
        assert problem is None
        check_gdn_backend_usable("fla", torch.device("cuda", 0))
    else:
        assert "fla-core >= 0.6.0" in problem and "Triton to >= 3.7.1" in problem


def test_check_runs_when_the_model_is_built(monkeypatch, tmp_path):
    """The guard fires in the provider's provide(), before any forward pass."""
    qwen35 = qwen35_module()
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen35

    build_tiny_qwen35(str(tmp_path))
    monkeypatch.setattr(qwen35, "_build_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(fla_backend, "hopper_backward_problem", lambda device: "Triton >= 3.7.1 or tilelang needed")
    with pytest.raises(RuntimeError, match="tilelang"):
        load_model(str(tmp_path), PrefixSharingConfig(gdn_backend="fla"))


def test_mtp_layers_are_dropped_with_a_warning(caplog):
    make_prefix_shared = qwen35_module().make_prefix_shared

    provider = types.SimpleNamespace(mtp_num_layers=1, num_moe_experts=None)
    with caplog.at_level(logging.WARNING, logger="ps_bridge"):
        make_prefix_shared(provider, "auto")
    assert provider.mtp_num_layers is None
    assert "multi-token-prediction" in caplog.text


def test_gdn_backend_from_environment_reaches_the_provider(monkeypatch, tmp_path):
    """`PS_BRIDGE_GDN_BACKEND` is read by config.py only; the config given to `register_all` puts it
    on every provider our bridges build (as in a verl worker, where Megatron-Bridge builds them)."""
    from megatron.bridge import AutoBridge

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.providers.registry import register_all
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen35

    build_tiny_qwen35(str(tmp_path))
    monkeypatch.setenv("PS_BRIDGE_GDN_BACKEND", "torch_ref")
    try:
        register_all(PrefixSharingConfig.from_env())
        provider = AutoBridge.from_hf_pretrained(str(tmp_path)).to_megatron_provider(load_weights=False)
        assert provider.gdn_backend == "torch_ref"
        monkeypatch.delenv("PS_BRIDGE_GDN_BACKEND")
        register_all(PrefixSharingConfig.from_env())
        provider = AutoBridge.from_hf_pretrained(str(tmp_path)).to_megatron_provider(load_weights=False)
        assert provider.gdn_backend == "auto"
    finally:
        register_all()
