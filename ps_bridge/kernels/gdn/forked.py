"""Gated DeltaNet (Qwen3.5) on a prefix tree: each node starts from its parent's final states.

A GDN layer's sequence mixing is a causal depthwise conv1d followed by the gated delta rule; both
carry state along the sequence (the last W conv inputs, and the `[HV, K, V]` recurrent state). With
prefix sharing a node does not see its ancestors' tokens, it starts from its parent's *final
states*. `prefix_shared_gated_delta_net` runs the delta rule once per tree level (`plan.levels`:
the roots with `output_final_state=True`, then each level from the states of the level before,
indexed by `GDNLevel.parent`: `fork_states`); a one-level layout is two calls, prompts and then
responses. The fork is an `index_select`, so in the backward every child's state gradient is
summed into its parent's state: exactly the unshared gradient. The conv needs one call only: its
state is the last W inputs of the ancestor path, gathered directly.

`backend` is a `GDNBackend` (ps_bridge.kernels.gdn.registry) providing the two varlen kernels,
`causal_conv1d` and `gated_delta_rule`; `plan` a `GDNPlan` (ps_bridge.kernels.gdn.plan).
"""

from __future__ import annotations

from typing import Optional

import torch

from ps_bridge.kernels.gdn.inputs import l2_normalize
from ps_bridge.kernels.gdn.plan import GDNPlan


def fork_states(parent_states: torch.Tensor, parent_index: torch.Tensor) -> torch.Tensor:
    """Each node's initial state: its parent's final state (`[n, ...]`, differentiable)."""
    return parent_states.index_select(0, parent_index)


def forked_causal_conv1d(x, weight, bias, plan: GDNPlan, backend, activation="silu", fork: bool = True, tails=None):
    """Causal conv over compacted `x [L, D]`, each node continuing from its ancestor path's inputs.

    A conv state is only the last W raw *inputs*, which are known before the conv runs, so unlike the
    delta rule this needs no pass per level: one varlen call covers every node, each starting from
    the tail of its ancestor path (gathered with `conv_tail_index`, so the backward adds the nodes'
    state gradients into their ancestors' inputs). One call instead of one per level matters where
    the GPU work is small: each fla call costs about a millisecond of host time.
    `fork=False` starts every node from zeros (a deliberately wrong variant, for negative tests).
    `tails`: the `(index, mask)` of `plan.conv_tail_index` given by the caller (a bucketed layout's,
    `plan.bucketed_conv_tails`)."""
    chunks = plan.conv_chunk_index
    if plan.depth == 0 or not fork:
        y, _ = backend.causal_conv1d(x, weight, bias, plan.cu_all, plan.cu_all_host, None, False, activation, chunks)
        return y
    D, W = weight.shape
    index, valid = plan.conv_tail_index(W, x.device) if tails is None else tails
    tails = x.index_select(0, index).view(-1, W, D) * valid.unsqueeze(-1).to(x.dtype)  # [N, W, D]
    init = tails.transpose(1, 2)  # fla's [N, D, W]
    y, _ = backend.causal_conv1d(x, weight, bias, plan.cu_all, plan.cu_all_host, init, False, activation, chunks)
    return y


def forked_gated_delta_rule(q, k, v, g, beta, scale, plan: GDNPlan, backend, fork: bool = True):
    """Gated delta rule over compacted tokens, one call per tree level, each node from its parent's
    final state (a level's filler sequences, under level buckets, from zeros)."""
    sizes = [level.end - level.start for level in plan.levels]
    if plan.levels[0].start != 0 or sum(sizes) != q.shape[0]:
        raise ValueError(f"the plan's levels cover tokens {plan.levels[0].start}..{plan.levels[-1].end}, "
                         f"the delta rule received {q.shape[0]}")
    inputs = (q, k, v, g, beta)
    # the levels tile the tokens: one split per input, whose backward is one cat, where a slice per
    # level would zero-fill the whole input's gradient for each level, copy its part in, and sum them
    pieces = [inputs] if len(sizes) == 1 else zip(*(torch.split(t, sizes) for t in inputs))
    outs = []
    states = None
    for level, (q_, k_, v_, g_, beta_) in zip(plan.levels, pieces):
        init = None
        if level.parent is not None and fork:
            init = fork_states(states, level.parent)
            if level.fillers:
                init = torch.cat([init, init.new_zeros(level.fillers, *init.shape[1:])])
        o, states = backend.gated_delta_rule(
            q_, k_, v_, g_, beta_, scale, level.cu, level.cu_host, init, level.has_children, level.chunk_index,
        )
        outs.append(o)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def prefix_shared_gated_delta_net(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    plan: GDNPlan,
    backend,
    *,
    num_key_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    use_qk_l2norm: bool = True,
    scale: Optional[float] = None,
    activation: str = "silu",
    fork: bool = True,
    token_mask: Optional[torch.Tensor] = None,
    conv_tails=None,
) -> torch.Tensor:
    """GDN sequence mixing over flattened input tokens (padding included).

    mixed_qkv `[N, 2*H*K + HV*V]` (conv input, channels q|k|v), g (log decay) and beta `[N, HV]`,
    conv_weight `[D, W]`. Returns `[N, HV, V]`, zero at padding positions.
    A plan of padded segments (a bucketed layout's, `plan.py`) takes `token_mask` `[N]` (True at
    valid tokens: the padding gets g = 0 and beta = 0, so no state changes there) and `conv_tails`
    (`plan.bucketed_conv_tails`)."""
    if mixed_qkv.shape[0] != plan.num_input_tokens:
        raise ValueError(
            f"Gated DeltaNet received {mixed_qkv.shape[0]} tokens but the plan describes {plan.num_input_tokens}"
        )
    idx = plan.gather_index
    if idx is not None:  # compact: the valid tokens of every node, level by level
        mixed_qkv, g, beta = mixed_qkv.index_select(0, idx), g.index_select(0, idx), beta.index_select(0, idx)
    if token_mask is not None:
        keep = token_mask.unsqueeze(-1)
        g, beta = g * keep.to(g.dtype), beta * keep.to(beta.dtype)
    qkv = forked_causal_conv1d(mixed_qkv, conv_weight, conv_bias, plan, backend, activation, fork=fork, tails=conv_tails)
    qk_dim = num_key_heads * key_head_dim
    q, k, v = torch.split(qkv, [qk_dim, qk_dim, qkv.shape[-1] - 2 * qk_dim], dim=-1)
    L = qkv.shape[0]
    q = q.reshape(L, num_key_heads, key_head_dim)
    k = k.reshape(L, num_key_heads, key_head_dim)
    v = v.reshape(L, -1, value_head_dim)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = key_head_dim**-0.5 if scale is None else scale
    o = forked_gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), scale, plan, backend, fork=fork
    )
    if idx is not None:
        o = o.new_zeros(plan.num_input_tokens, *o.shape[1:]).index_copy(0, idx, o)
    if token_mask is not None:
        o = o * token_mask.view(-1, 1, 1).to(o.dtype)
    return o
