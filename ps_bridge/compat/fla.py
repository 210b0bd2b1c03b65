"""What differs between the fla-core releases ps-bridge runs on (0.4.2 - 0.6.0).

- `causal_conv1d`: `fla.modules.causal_conv1d` (a package) from 0.6 on, `fla.modules.conv` in 0.4.2 -
  0.5.x; the same signature (`backend`, `cu_seqlens`, `cu_seqlens_cpu`, initial / final states).
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
