"""Reference backend: one dense masked softmax per root of the prefix tree, in plain PyTorch.

A token attends to every valid token of its node's ancestors and causally inside its own node (a
one-level layout: a response token to its whole prompt and to its own response so far; a prompt
token causally inside its prompt). Exact on any device and easy to read; its cost is quadratic in a
root's packed subtree, which is fine for tests and small batches and is what the fast backends are
checked against.
"""

from __future__ import annotations

import torch

from ps_bridge.layout import PackedPrefixLayout


def prefix_shared_mask(layout: PackedPrefixLayout, index: torch.Tensor) -> torch.Tensor:
    """Boolean `[n, n]` mask (True = may attend) among the packed positions `index` of one root's
    subtree: key k is in an ancestor-or-self node of query q (depth-first intervals:
    `tin[k] <= tin[q] < tout[k]`), valid, and not after q."""
    tin, tout = (x[index] for x in layout.token_intervals())
    pos = layout.positions[index]
    valid = layout.valid[index]
    ancestor_or_self = (tin[None, :] <= tin[:, None]) & (tin[:, None] < tout[None, :])
    mask = ancestor_or_self & (pos[None, :] <= pos[:, None]) & valid[None, :]
    # a padding query attends to itself only, so its row stays finite
    return mask | torch.diag(~valid)


def prefix_shared_attention_torch_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedPrefixLayout, softmax_scale: float
) -> torch.Tensor:
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    rep = Hq // Hkv
    # accumulate in float32 at least (float64 stays float64, for exactness tests)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    group_ids = layout.group_ids
    for g in range(layout.num_groups):
        index = (group_ids == g).nonzero().squeeze(1)
        qg = q.index_select(0, index).transpose(0, 1)  # [Hq, n, D]
        kg = k.index_select(0, index).transpose(0, 1).repeat_interleave(rep, dim=0)
        vg = v.index_select(0, index).transpose(0, 1).repeat_interleave(rep, dim=0)
        mask = prefix_shared_mask(layout, index)
        scores = torch.matmul(qg.to(acc), kg.to(acc).transpose(1, 2)) * softmax_scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        og = torch.matmul(probs, vg.to(acc)).to(q.dtype)  # [Hq, n, D]
        out.index_copy_(0, index, og.transpose(0, 1))
    return out
