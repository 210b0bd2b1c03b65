"""The small adapters of `ps_bridge/compat/` on both sides of each version difference (the side this
stack lacks is faked: a fake function signature, a removed attribute, a faked version)."""

from __future__ import annotations

import types

import pytest
import torch

from ps_bridge.compat import fla as compat_fla
from ps_bridge.compat import flash_attn as compat_flash_attn
from ps_bridge.compat import megatron_core as compat_megatron_core
from ps_bridge.compat import torch as compat_torch
from ps_bridge.compat import triton as compat_triton
from ps_bridge.compat import verl as compat_verl

pytestmark = pytest.mark.core


def test_grouped_mm_public_or_private(monkeypatch):
    """torch 2.14.1: `torch.nn.functional.grouped_mm`; 2.9.1: only `torch._grouped_mm`; neither: refused."""
    public = getattr(torch.nn.functional, "grouped_mm", None)
    assert compat_torch.grouped_mm() is (public or torch._grouped_mm)
    monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
    assert compat_torch.grouped_mm() is torch._grouped_mm
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(RuntimeError, match="torch >= 2.9"):
        compat_torch.grouped_mm()


def test_fused_group_mlp_offloading_flag():
    assert compat_megatron_core.offloads_fused_group_mlp(types.SimpleNamespace(offload_fused_group_mlp=True))
    assert not compat_megatron_core.offloads_fused_group_mlp(types.SimpleNamespace(offload_fused_group_mlp=False))
    assert not compat_megatron_core.offloads_fused_group_mlp(types.SimpleNamespace())  # megatron-core 0.18


def test_optimizer_state_dict_builder():
    class Manager091:
        def _build_optimizer_state_dict(self, model_sharded_state_dict, metadata, is_loading=False):
            pass

    assert compat_verl.optimizer_state_dict_builder(Manager091) is Manager091._build_optimizer_state_dict
    assert compat_verl.optimizer_state_dict_builder(object) is None  # verl 0.8.0's manager


def _old_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout, scale, causal, window_size, return_softmax):
    pass


def _new_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout, scale, causal, window_size_left=-1,
             window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
    pass


def test_flash_attn_keywords_follow_the_signature():
    assert compat_flash_attn.varlen_keywords(_old_fwd, return_softmax=False) == dict(
        return_softmax=False, window_size=(-1, -1))
    assert compat_flash_attn.varlen_keywords(_new_fwd, return_softmax=False) == dict(
        return_softmax=False, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None)


@pytest.mark.parametrize("version, wrong", [("3.3.1", False), ("3.4.0", True), ("3.6.0+git1", True),
                                            ("3.7.1", False), ("3.8.0", False)])
def test_triton_versions_with_the_wrong_hopper_gdn_backward(monkeypatch, version, wrong):
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", version)
    assert compat_triton.wrong_hopper_gdn_backward() == (version if wrong else None)


def test_fla_takes_the_chunk_index_and_its_identity_cache_turns_off():
    """What level buckets rely on, against the installed fla-core: `takes_chunk_indices` is True where
    the delta rule and the conv name `chunk_indices` (fla-core 0.6.0; 0.4.2 takes them through
    **kwargs and ignores them), and there `identity_cache_off` makes fla's identity cache derive anew
    inside and cache again after."""
    import inspect

    named = all("chunk_indices" in inspect.signature(fn).parameters
                for fn in (compat_fla.chunk_gated_delta_rule(), compat_fla.causal_conv1d()))
    assert compat_fla.takes_chunk_indices() == named
    if not named:
        return
    from fla.utils import tensor_cache

    calls = []

    @tensor_cache
    def derive(x):
        calls.append(x)
        return x + 1

    x = torch.zeros(2)
    derive(x), derive(x)
    assert len(calls) == 1
    with compat_fla.identity_cache_off():
        derive(x), derive(x)
    assert len(calls) == 3
    derive(x)
    assert len(calls) == 3
