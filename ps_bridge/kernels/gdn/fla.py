"""The `fla` Gated DeltaNet backend: fla-core's Triton kernels (GPU), `causal_conv1d` and `chunk_gated_delta_rule`.

One call covers a whole varlen block (one level of the prefix tree: all roots, or all nodes of one
depth, `forked.py`) with per-sequence initial and final states, so trees of any depth run here.
CPU copies of `cu_seqlens` are passed so fla does not sync the device to read them; a level-bucketed
plan's offsets live on the device only (`plan.py`) and come with their chunk index instead.
They, and the chunk index of the delta rule and the conv, are made once per plan and handed to fla
as the same objects on every layer (`_per_plan`): made per call, they cost host work and a
host-to-device copy once per tree level and layer on the shared path. They live as long as the
plan's `cu_seqlens`, not in a bounded cache: a CUDA graph captured on the plan reads the chunk index
at every replay (`ps_bridge.cuda_graphs`), so nothing may free it while the graph's layout lives.
For the same reason fla is handed the chunk index rather than deriving it in its own identity
cache (`fla.utils.tensor_cache`, a few entries deep), where fla-core takes it (>= 0.6.0).
q/k keep their H key heads: fla applies grouped value heads natively with the same head mapping as
`repeat_interleave` (value head j reads key head j // (HV / H)), which the GPU test checks.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ps_bridge.compat import fla as compat_fla
from ps_bridge.compat import triton as compat_triton


CHUNK_SIZE = 64  # the default chunk size of fla's delta rule and conv, for which the chunk index is made
# a plan's device cu_seqlens -> [its host list, the CPU copy, the chunk index or None]; an entry goes
# with its key tensor
_PER_PLAN: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _per_plan(cu_seqlens: torch.Tensor, host: List[int], chunk_index: bool):
    """(CPU cu_seqlens, chunk index or None) for a plan's `cu_seqlens` and its host list, made once and
    then returned as the same objects while `cu_seqlens` lives (the entry holds no reference to it)."""
    entry = _PER_PLAN.get(cu_seqlens)
    if entry is None or entry[0] is not host:
        entry = [host, torch.tensor(host, dtype=torch.long), None]
        _PER_PLAN[cu_seqlens] = entry
    if chunk_index and entry[2] is None:
        # imported here: fla is heavy (it loads triton and probes the GPU)
        from fla.ops.utils.index import prepare_chunk_indices

        entry[2] = prepare_chunk_indices(cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=entry[1])
    return entry[1], entry[2]


def _offsets(cu_seqlens, cu_seqlens_host, chunk_indices, chunk_index: bool):
    """(CPU cu_seqlens, chunk index) fla gets: a plan's own (`_per_plan`), or, for offsets on the
    device only (`cu_seqlens_host` None: a level-bucketed plan, whose offsets a CUDA graph's replay
    refills), no CPU copy and the plan's device chunk index, so that fla reads nothing on the host."""
    if cu_seqlens_host is None:
        return None, chunk_indices
    return _per_plan(cu_seqlens, cu_seqlens_host, chunk_index=chunk_index)


def causal_conv1d(x, weight, bias, cu_seqlens, cu_seqlens_host, initial_state, output_final_state, activation,
                  chunk_indices=None):
    # the conv's chunks are the delta rule's size (CHUNK_SIZE): one chunk index serves both
    cpu, chunk_indices = _offsets(cu_seqlens, cu_seqlens_host, chunk_indices,
                                  chunk_index=compat_fla.takes_chunk_indices())
    extra = {} if chunk_indices is None else dict(chunk_indices=chunk_indices)
    y, final = compat_fla.causal_conv1d()(
        x=x.unsqueeze(0),
        weight=weight,
        bias=bias,
        initial_state=initial_state,
        output_final_state=output_final_state,
        activation=activation,
        backend="triton",
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cpu,
        **extra,
    )
    return y.squeeze(0), final


def gated_delta_rule(q, k, v, g, beta, scale, cu_seqlens, cu_seqlens_host, initial_state, output_final_state,
                     chunk_indices=None):
    cpu, chunk_indices = _offsets(cu_seqlens, cu_seqlens_host, chunk_indices, chunk_index=True)
    # fla-core 0.4.2 - 0.5.x take chunk_indices / chunk_size through **kwargs and ignore them
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
        cu_seqlens_cpu=cpu,
        chunk_indices=chunk_indices,
        chunk_size=CHUNK_SIZE,
    )
    return o.squeeze(0), final


def hopper_backward_problem(device: torch.device) -> Optional[str]:
    """Why fla's GDN backward cannot run on `device`, or None when it can.

    fla-core 0.6.0 refuses the gated `chunk_bwd_dqkwg` kernel on Hopper (sm_90) with
    3.4.0 <= Triton < 3.7.1 (those Triton versions compute wrong gradients), unless tilelang is
    installed, in which case fla dispatches that kernel to tilelang; fla-core before 0.6.0 has no such
    route and computes those gradients wrongly without a word (`compat.fla.tilelang_backward_route`).
    We check up front, when the model is built, instead of failing in the first backward pass.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return None
    triton_version = compat_triton.wrong_hopper_gdn_backward()
    if triton_version is None or compat_fla.tilelang_backward_route():
        return None
    return (
        f"the fla Gated DeltaNet backward is refused on this Hopper GPU ({torch.cuda.get_device_name(device)}) "
        f"with Triton {triton_version}: Triton >= 3.4.0 and < 3.7.1 computes wrong gradients for fla's "
        "gated chunk_bwd_dqkwg kernel. Fix it either way: upgrade Triton to >= 3.7.1 "
        "(e.g. a torch release that ships it), or `pip install tilelang` with fla-core >= "
        f"{compat_fla.TILELANG_ROUTE_SINCE} (fla then runs that kernel with tilelang; older fla-core has no "
        "tilelang route)."
    )
