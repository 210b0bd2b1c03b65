"""What differs between the fla-core releases ps-bridge runs on (0.4.2 - 0.6.0).

- `causal_conv1d`: `fla.modules.causal_conv1d` (a package) from 0.6 on, `fla.modules.conv` in 0.4.2 -
  0.5.x; the same signature (`backend`, `cu_seqlens`, `cu_seqlens_cpu`, initial / final states).
- the tilelang route for the gated `chunk_bwd_dqkwg` backward on Hopper (the kernel Triton 3.4.0 -
  3.7.0 computes wrongly) exists from 0.6.0 on; 0.4.2 has none and runs the wrong Triton kernel
  silently, with or without tilelang installed (`tilelang_backward_route`).
- `chunk_gated_delta_rule` is `fla.ops.gated_delta_rule.chunk_gated_delta_rule` in all of them
  (0.4.2 is the first whose signature takes `cu_seqlens_cpu`).
"""

from __future__ import annotations


def causal_conv1d():
    """fla's varlen causal conv function of this fla-core."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fn
    except ImportError:  # fla-core 0.4.2 - 0.5.x
        from fla.modules.conv import causal_conv1d as fn
    return fn


def chunk_gated_delta_rule():
    """fla's chunked gated delta rule of this fla-core."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn

    return fn


TILELANG_ROUTE_SINCE = "0.6.0"


def tilelang_backward_route() -> bool:
    """Whether this fla-core dispatches the Hopper-sensitive backward kernel to tilelang: tilelang is
    installed and fla-core is one that has that route (>= 0.6.0; the releases before it have none)."""
    import importlib.metadata
    import importlib.util

    from packaging.version import Version

    if importlib.util.find_spec("tilelang") is None:
        return False
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:  # unpacked without its metadata
        import fla

        version = getattr(fla, "__version__", "0")
    return Version(version) >= Version(TILELANG_ROUTE_SINCE)
