"""`flex`: prefix-shared attention with FlexAttention.

One `flex_attention` call over the whole pack with a block mask built from the layout's depth-first
intervals: key k is visible to query q when k's node is an ancestor of q's node or q's node itself
(`tin[k] <= tin[q] < tout[k]`), k is valid, and k is not after q in the pack (the pack goes level
by level, so an ancestor's tokens always come first; inside a node this is the causal order). This
is any prefix tree, a one-level layout (prompts, responses) included. Blocks where nothing is
visible are skipped by the kernel, so the cost follows the shared pattern rather than the pack's
square.

Recompilation: the compiled kernels and the block mask are specialised on the sequence length. The
pack is therefore padded up to a *bucket* length (a power of two times 1, 1.25, 1.5 or 1.75, at
least 256), so micro-batches of varying lengths reuse a handful of compiled variants instead of
compiling once per length. Bucket padding tokens see nothing and are seen by nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ps_bridge.kernels.backend import compile_allowed
from ps_bridge.layout import PackedPrefixLayout

MIN_BUCKET = 256


def bucket_length(n: int) -> int:
    """Smallest length >= n of the form 2^e * {1, 1.25, 1.5, 1.75} (and >= MIN_BUCKET)."""
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    base = 1 << (n.bit_length() - 1)
    for num in (4, 5, 6, 7, 8):
        cand = base * num // 4
        if cand >= n:
            return cand
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    # imported here: FlexAttention loads torch's compiler stack; only this backend needs it
    from torch.nn.attention.flex_attention import flex_attention

    with compile_allowed():
        return torch.compile(flex_attention, dynamic=False)


def _flex_for(device: torch.device):
    """Compiled on CUDA (the eager version is a slow reference); eager elsewhere."""
    if device.type == "cuda":
        return _compiled_flex()
    # imported here: FlexAttention loads torch's compiler stack; only this backend needs it
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@dataclass
class FlexPlan:
    length: int  # bucketed pack length
    block_mask: object


def _token_metadata(layout: PackedPrefixLayout, length: int, device):
    """Per-token depth-first interval and validity, padded to `length`; bucket padding is an invalid
    token with an empty interval [-1, -1), so it matches nothing."""
    T = layout.num_tokens

    def pad(x, fill):
        x = x.to(device)
        return torch.cat([x, x.new_full((length - T,), fill)]) if length > T else x

    tin, tout = layout.token_intervals()
    return pad(tin, -1), pad(tout, -1), pad(layout.valid, False)


def flex_plan(layout: PackedPrefixLayout, device) -> FlexPlan:
    device = torch.device(device)
    return layout.derived(("flex_plan", device), lambda: _build_flex_plan(layout, device))


def _build_flex_plan(layout: PackedPrefixLayout, device: torch.device) -> FlexPlan:
    # imported here: FlexAttention loads torch's compiler stack; only this backend needs it
    from torch.nn.attention.flex_attention import create_block_mask

    length = bucket_length(layout.num_tokens)
    tin, tout, valid = _token_metadata(layout, length, device)

    def prefix_shared_mask(b, h, q_idx, kv_idx):
        ancestor_or_self = (tin[kv_idx] <= tin[q_idx]) & (tin[q_idx] < tout[kv_idx])
        return ancestor_or_self & valid[kv_idx] & (kv_idx <= q_idx)

    # compiled mask construction never materialises the [length, length] mask
    with compile_allowed():
        block_mask = create_block_mask(
            prefix_shared_mask, None, None, length, length, device=device, _compile=device.type == "cuda"
        )
    return FlexPlan(length=length, block_mask=block_mask)


def prefix_shared_attention_flex(q, k, v, layout: PackedPrefixLayout, softmax_scale: float) -> torch.Tensor:
    T, Hq, D = q.shape
    if k.shape[0] != T or T != layout.num_tokens:
        raise ValueError(f"q/k have {T}/{k.shape[0]} tokens, the layout {layout.num_tokens}")
    if Hq % k.shape[1]:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({k.shape[1]})")
    plan = flex_plan(layout, q.device)
    extra = plan.length - T

    def to_bhsd(x):
        if extra:
            x = torch.cat([x, x.new_zeros((extra,) + tuple(x.shape[1:]))])
        return x.transpose(0, 1).unsqueeze(0)

    out = _flex_for(q.device)(
        to_bhsd(q), to_bhsd(k), to_bhsd(v),
        block_mask=plan.block_mask, scale=float(softmax_scale), enable_gqa=Hq != k.shape[1],
    )
    # fully masked rows (padding) come out as zeros, which nobody reads
    return out[0].transpose(0, 1)[:T]
