"""Reference backend: one dense masked softmax per group, in plain PyTorch.

Exact on any device and easy to read; its cost is quadratic in a group's packed length, which is
fine for tests and small batches and is what the fast backends are checked against.
"""

from __future__ import annotations

import torch

from ps_bridge.layout import PackedPrefixLayout


def prefix_shared_mask(layout: PackedPrefixLayout, index: torch.Tensor) -> torch.Tensor:
    """Boolean `[n, n]` mask (True = may attend) among the packed positions `index` of one group."""
    pos = layout.positions[index]
    seg = layout.segment_ids[index]
    prompt = layout.is_prompt[index]
    valid = layout.valid[index]
    q_pos, k_pos = pos[:, None], pos[None, :]
    same_segment = seg[:, None] == seg[None, :]
    mask = (k_pos <= q_pos) & (same_segment | prompt[None, :]) & valid[None, :]
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
