"""The attention and Gated DeltaNet registries: one shape, `auto` resolved by one function each."""

import dataclasses

import pytest
import torch

from ps_bridge.kernels.attention import BACKENDS, choose_attention_backend, get_attention_backend, resolve_attention_backend
from ps_bridge.kernels.backend import Backend
from ps_bridge.kernels.gdn import GDN_BACKENDS, choose_gdn_backend, resolve_gdn_backend

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("registry", [BACKENDS, GDN_BACKENDS])
def test_entries_are_frozen_backend_records_keyed_by_name(registry):
    assert "auto" in registry and "torch_ref" in registry
    for name, backend in registry.items():
        assert isinstance(backend, Backend) and backend.name == name and backend.description
        with pytest.raises(dataclasses.FrozenInstanceError):
            backend.name = "other"


def test_attention_auto_choice():
    assert choose_attention_backend(CUDA, torch.bfloat16, 128) == "flash_atten_gpu"
    assert choose_attention_backend(CUDA, torch.float16, 256) == "flash_atten_gpu"
    assert choose_attention_backend(CUDA, torch.float32, 128) == "torch_ref"  # exactness runs
    assert choose_attention_backend(CUDA, torch.bfloat16, 260) == "torch_ref"  # head dim past the flash kernels
    assert choose_attention_backend(CUDA, torch.bfloat16, 12) == "torch_ref"
    assert choose_attention_backend(CPU, torch.bfloat16, 128) == "torch_ref"
    assert resolve_attention_backend("auto", torch.zeros(2, 2, 64, dtype=torch.bfloat16)).name == "torch_ref"


def test_gdn_auto_choice():
    assert choose_gdn_backend(CUDA) == "fla"
    assert choose_gdn_backend(CPU) == "torch_ref"
    # the auto entry's kernels pick per call from their inputs' device
    x, w, cu = torch.randn(5, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64), [0, 2, 5]
    args = (x, w, None, torch.tensor(cu), cu, None, True, "silu")
    auto_y, auto_state = GDN_BACKENDS["auto"].causal_conv1d(*args)
    ref_y, ref_state = GDN_BACKENDS["torch_ref"].causal_conv1d(*args)
    assert torch.equal(auto_y, ref_y) and torch.equal(auto_state, ref_state)


def test_unknown_names_and_wrong_devices_give_one_error_form():
    with pytest.raises(ValueError, match=r"unknown prefix-sharing attention backend 'x'; valid backends: auto, "):
        get_attention_backend("x")
    with pytest.raises(ValueError, match=r"unknown Gated DeltaNet backend 'x'; valid backends: auto, "):
        resolve_gdn_backend("x", CPU)
    with pytest.raises(ValueError, match="the flash_atten_npu prefix-sharing attention backend needs an NPU device"):
        resolve_attention_backend("flash_atten_npu", torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match="the fla Gated DeltaNet backend needs a CUDA device"):
        resolve_gdn_backend("fla", CPU)
