"""Reference Gated DeltaNet kernels in plain PyTorch: exact, any device, slow.

Sequences are looped and the recurrence runs token by token in float32, so these are the
definitions the fast backends are checked against. Shapes follow fla-core's varlen API without the
leading batch dimension of 1:

- conv state `[N, D, W]`: the last W raw (pre-activation) inputs of each sequence, left-padded with
  zeros (or with the initial state) when a sequence is shorter than W. Column 0 is never read by the
  next convolution; keeping W columns makes the state interchangeable with fla's.
- recurrent state `[N, HV, K, V]`, float32 (float64 for float64 inputs).

`cu_seqlens_host` None: the offsets are read from `cu_seqlens` (a level-bucketed plan keeps them on
the device only, `plan.py`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F


def _host(cu_seqlens: torch.Tensor, cu_seqlens_host: Optional[List[int]]) -> List[int]:
    """The offsets the loops read: the host list, or the device tensor's values where the plan keeps
    none (a level-bucketed plan, whose offsets a replay refills). `chunk_indices` (fla's) are not
    needed by these loops."""
    return cu_seqlens.tolist() if cu_seqlens_host is None else cu_seqlens_host


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: List[int],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    activation: Optional[str],
    chunk_indices: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Depthwise causal conv over each sequence of `x [L, D]`, `weight [D, W]`."""
    cu_seqlens_host = _host(cu_seqlens, cu_seqlens_host)
    D, W = weight.shape
    outs, finals = [], []
    for i in range(len(cu_seqlens_host) - 1):
        a, b = cu_seqlens_host[i], cu_seqlens_host[i + 1]
        xs = x[a:b].transpose(0, 1)  # [D, n]
        state = initial_state[i].to(x.dtype) if initial_state is not None else x.new_zeros(D, W)
        full = torch.cat([state, xs], dim=1)  # [D, W + n]: the state is the left context
        y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=D)[0]  # [D, n + 1]
        y = y[:, 1:]  # output t sees inputs t-W+1..t; the first column would be state-only
        if activation in ("silu", "swish"):
            y = F.silu(y)
        elif activation is not None:
            raise ValueError(f"unsupported conv activation {activation!r}; use 'silu' or None")
        outs.append(y.transpose(0, 1))
        if output_final_state:
            finals.append(full[:, -W:])
    y = torch.cat(outs, dim=0) if outs else x.new_zeros(0, D)
    final = torch.stack(finals) if output_final_state else None
    return y, final


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: List[int],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    chunk_indices: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule per sequence: `S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_t k_t))^T`,
    `o_t = scale * S_t^T q_t` with `S'_t = exp(g_t) S_{t-1}`.

    `q, k [L, H, K]`, `v [L, HV, V]`, `g, beta [L, HV]`; grouped value heads (HV a multiple of H)
    repeat each q/k head for HV/H consecutive value heads (repeat_interleave, as HF and Megatron)."""
    cu_seqlens_host = _host(cu_seqlens, cu_seqlens_host)
    L, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    rep = HV // H
    acc = torch.promote_types(v.dtype, torch.float32)  # float32 at least; float64 stays float64
    qf = q.to(acc).repeat_interleave(rep, dim=1) * scale
    kf = k.to(acc).repeat_interleave(rep, dim=1)
    vf, gf, bf = v.to(acc), g.to(acc), beta.to(acc)
    outs, finals = [], []
    for i in range(len(cu_seqlens_host) - 1):
        a, b = cu_seqlens_host[i], cu_seqlens_host[i + 1]
        S = initial_state[i].to(acc) if initial_state is not None else vf.new_zeros(HV, K, V)
        seq_out = []
        for t in range(a, b):
            S = S * gf[t].exp()[:, None, None]
            predicted = torch.einsum("hk,hkv->hv", kf[t], S)
            delta = (vf[t] - predicted) * bf[t][:, None]
            S = S + kf[t][:, :, None] * delta[:, None, :]
            seq_out.append(torch.einsum("hk,hkv->hv", qf[t], S))
        if seq_out:
            outs.append(torch.stack(seq_out))
        if output_final_state:
            finals.append(S)
    o = torch.cat(outs, dim=0).to(v.dtype) if outs else v.new_zeros(0, HV, V)
    final = torch.stack(finals) if output_final_state else None
    return o, final
