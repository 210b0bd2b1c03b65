"""The `fla` Gated DeltaNet backend: fla-core's Triton kernels (GPU), `causal_conv1d` and `chunk_gated_delta_rule`.

One call covers a whole varlen block (all prompts, or all responses) with per-sequence initial and
final states. CPU copies of `cu_seqlens` are passed so fla does not sync the device to read them.
q/k keep their H key heads: fla applies grouped value heads natively with the same head mapping as
`repeat_interleave` (value head j reads key head j // (HV / H)), which the GPU test checks.
"""

from __future__ import annotations

import importlib.util
from typing import List, Optional

import torch

from ps_bridge.compat import fla as compat_fla


def _cpu(host: List[int]) -> torch.Tensor:
    return torch.tensor(host, dtype=torch.long)


def causal_conv1d(x, weight, bias, cu_seqlens, cu_seqlens_host, initial_state, output_final_state, activation):
    y, final = compat_fla.causal_conv1d()(
        x=x.unsqueeze(0),
        weight=weight,
        bias=bias,
        initial_state=initial_state,
        output_final_state=output_final_state,
        activation=activation,
        backend="triton",
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=_cpu(cu_seqlens_host),
    )
    return y.squeeze(0), final


def gated_delta_rule(q, k, v, g, beta, scale, cu_seqlens, cu_seqlens_host, initial_state, output_final_state):
    o, final = compat_fla.chunk_gated_delta_rule()(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g.unsqueeze(0),
        beta.unsqueeze(0),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=_cpu(cu_seqlens_host),
    )
    return o.squeeze(0), final


def hopper_backward_problem(device: torch.device) -> Optional[str]:
    """Why fla's GDN backward cannot run on `device`, or None when it can.

    fla-core 0.6.0 refuses the gated `chunk_bwd_dqkwg` kernel on Hopper (sm_90) with
    3.4.0 <= Triton < 3.7.1 (those Triton versions compute wrong gradients), unless tilelang is
    installed, in which case fla dispatches that kernel to tilelang. We check up front, when the
    model is built, instead of failing in the first backward pass.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return None
    try:
        import triton
        from packaging.version import Version

        triton_version = Version(triton.__version__.split("+")[0])
    except Exception:  # no triton at all: fla cannot run either; its own import error says so
        return None
    if not (Version("3.4.0") <= triton_version < Version("3.7.1")):
        return None
    if importlib.util.find_spec("tilelang") is not None:
        return None
    return (
        f"the fla Gated DeltaNet backward is refused on this Hopper GPU ({torch.cuda.get_device_name(device)}) "
        f"with Triton {triton.__version__}: Triton >= 3.4.0 and < 3.7.1 computes wrong gradients for fla's "
        "gated chunk_bwd_dqkwg kernel. Fix it either way: upgrade Triton to >= 3.7.1 "
        "(e.g. a torch release that ships it), or `pip install tilelang` (fla then runs that kernel "
        "with tilelang)."
    )
