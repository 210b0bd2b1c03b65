"""What differs between the fla-core releases ps-bridge runs on (0.4.2 - 0.6.0).

- `causal_conv1d`: `fla.modules.causal_conv1d` (a package) from 0.6 on, `fla.modules.conv` in 0.4.2 -
  0.5.x; the same signature (`backend`, `cu_seqlens`, `cu_seqlens_cpu`, initial / final states).
- the tilelang route for the gated `chunk_bwd_dqkwg` backward on Hopper (the kernel Triton 3.4.0 -
  3.7.0 computes wrongly) exists from 0.6.0 on; 0.4.2 has none and runs the wrong Triton kernel
  silently, with or without tilelang installed (`tilelang_backward_route`).
- fla's `input_guard` enters `custom_device_ctx(tensor.device.index)` around every kernel call. On a
  host where Triton has no GPU backend (fla falls back to `'cpu'`: Triton's CPU interpreter, what
  tests/test_gdn_fla_conv_interpreter.py runs) 0.4.2 returns `torch.cpu.device(None)`, which torch
  does not have (AttributeError); 0.6.0 returns a null context (`cpu_tensors_need_no_device`).
- `chunk_gated_delta_rule` is `fla.ops.gated_delta_rule.chunk_gated_delta_rule` in all of them
  (0.4.2 is the first whose signature takes `cu_seqlens_cpu`).
- the caller's `chunk_indices`: 0.6.0 takes them in the delta rule and the conv; 0.4.2 - 0.5.x take
  them through `**kwargs` and ignore them, deriving their own from `cu_seqlens` on the host
  (`takes_chunk_indices`). CUDA graphs of Gated DeltaNet layers need them taken (`ps_bridge.cuda_graphs`).
- fla memoizes what it derives from `cu_seqlens` (its chunk offsets) by the tensor's identity
  (`fla.utils.tensor_cache`, a few entries); `FLA_DISABLE_TENSOR_CACHE` on `fla.utils` turns that off
  (0.6.0), which every capture needs (`identity_cache_off`): a value taken from the cache would be read
  by the graph at each replay, but freed when the cache drops it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util

from packaging.version import Version


def cpu_tensors_need_no_device() -> None:
    """Make fla-core's per-call device context a null context for CPU tensors (device index None),
    where this fla-core's own raises (0.4.2 on a host with no GPU Triton backend: `torch.cpu.device`
    does not exist); a tensor with a device index keeps fla's context. Where fla's context already
    takes a CPU tensor (fla-core 0.6.0, any GPU host) nothing changes."""
    # imported here: fla is heavy (it loads triton and probes the GPU)
    import fla.utils

    try:
        fla.utils.custom_device_ctx(None)
        return
    except AttributeError:
        pass
    device_ctx = fla.utils.custom_device_ctx

    def custom_device_ctx(index):
        return contextlib.nullcontext() if index is None else device_ctx(index)

    fla.utils.custom_device_ctx = custom_device_ctx


def causal_conv1d():
    """fla's varlen causal conv function of this fla-core."""
    cpu_tensors_need_no_device()
    try:
        # imported here: fla is heavy (it loads triton and probes the GPU)
        from fla.modules.causal_conv1d import causal_conv1d as fn
    except ImportError:  # fla-core 0.4.2 - 0.5.x
        # imported here: fla is heavy (it loads triton and probes the GPU)
        from fla.modules.conv import causal_conv1d as fn
    return fn


def chunk_gated_delta_rule():
    """fla's chunked gated delta rule of this fla-core."""
    # imported here: fla is heavy (it loads triton and probes the GPU)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn

    return fn


TILELANG_ROUTE_SINCE = "0.6.0"
CHUNK_INDICES_SINCE = "0.6.0"


def fla_version() -> Version:
    """The installed fla-core's version."""
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:  # unpacked without its metadata
        # imported here: fla is heavy (it loads triton and probes the GPU)
        import fla

        version = getattr(fla, "__version__", "0")
    return Version(version)


def tilelang_backward_route() -> bool:
    """Whether this fla-core dispatches the Hopper-sensitive backward kernel to tilelang: tilelang is
    installed and fla-core is one that has that route (>= 0.6.0; the releases before it have none)."""

    if importlib.util.find_spec("tilelang") is None:
        return False
    return fla_version() >= Version(TILELANG_ROUTE_SINCE)


@functools.lru_cache(maxsize=None)
def takes_chunk_indices() -> bool:
    """Whether this fla-core's delta rule and conv use the caller's `chunk_indices` (>= 0.6.0); asked
    on every conv call, so read once."""
    return fla_version() >= Version(CHUNK_INDICES_SINCE)


@contextlib.contextmanager
def identity_cache_off():
    """fla's identity cache of values derived from `cu_seqlens` turned off inside: a CUDA graph
    captured inside records their derivation into its own memory, so that it follows a `cu_seqlens` a
    replay refills and reads nothing the cache may free."""
    # imported here: fla is heavy (it loads triton and probes the GPU)
    import fla.utils

    saved = getattr(fla.utils, "FLA_DISABLE_TENSOR_CACHE", False)
    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = saved
