"""Head-parallel context parallelism (CP) over contiguous shards of the packed sequence.

Each CP rank holds one contiguous, equal shard of the packed `[prompts][responses]` sequence
(`PackedPrefixLayout.cp_shard`) for everything position-wise: embedding, norms, projections,
MLP / MoE, the output layer, RoPE at the layout's per-token positions. The sequence mixers need the
whole pack: an all-to-all turns each rank's `[shard, heads]` into `[whole pack, heads / cp]`, the
prefix-shared kernels run unchanged on the whole layout with `heads / cp` heads, and a second
all-to-all gives every rank its shard of all heads back. The collectives are megatron-core's own
(`tensor_a2a_cp2hp` / `tensor_a2a_hp2cp` of its Gated DeltaNet, autograd-aware), without its
attention load balancing: our shards are contiguous, not zigzag.

Softmax attention: megatron does not replicate KV heads for CP, so when the KV heads of a TP rank
do not divide by the CP size they are repeated (each KV head `r` times, `r` the smallest factor
that makes them divide) before the all-to-all; every rank then holds the KV heads its query heads
read. Query heads per TP rank must divide by the CP size (`ParallelSettings.check_model`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ps_bridge.compat.megatron_core import gdn_cp_collectives


def cp_rank_size() -> Tuple[int, int]:
    """This process's (CP rank, CP size) in megatron's parallel state; (0, 1) without one."""
    if not dist.is_initialized():
        return 0, 1
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()


def _size(group) -> int:
    return 1 if group is None else group.size()


def to_head_shard(x: torch.Tensor, cp_group, split_sections: Optional[Sequence[int]] = None) -> torch.Tensor:
    """`[shard, channels]` -> `[whole pack, channels / cp]`: rank `r` gets the `r`-th slice of
    every section of `split_sections` (all channels as one section when None)."""
    tensor_a2a_cp2hp, _, _ = gdn_cp_collectives()
    out = tensor_a2a_cp2hp(
        x.unsqueeze(1), seq_dim=0, head_dim=-1, cp_group=cp_group,
        split_sections=None if split_sections is None else list(split_sections),
        undo_attention_load_balancing=False,
    )
    return out.squeeze(1)


def to_seq_shard(x: torch.Tensor, cp_group, split_sections: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The inverse of `to_head_shard`: `[whole pack, channels / cp]` -> `[shard, channels]`."""
    _, tensor_a2a_hp2cp, _ = gdn_cp_collectives()
    out = tensor_a2a_hp2cp(
        x.unsqueeze(1), seq_dim=0, head_dim=-1, cp_group=cp_group,
        split_sections=None if split_sections is None else list(split_sections),
        redo_attention_load_balancing=False,
    )
    return out.squeeze(1)


def kv_repeat(num_kv_heads: int, cp: int) -> int:
    """How many times each KV head is repeated so that `cp` ranks split them along with their
    query heads: the smallest `r` with `num_kv_heads * r` divisible by `cp`."""
    return cp // math.gcd(num_kv_heads, cp)


def attention_to_head_shards(query, key, value, cp_group):
    """THD `query [shard, Hq, D]`, `key/value [shard, Hkv, D]` -> the whole pack with `Hq / cp`
    query heads and the KV heads those read (`Hkv * r / cp`, see `kv_repeat`)."""
    cp = _size(cp_group)
    if cp == 1:
        return query, key, value
    hq, hkv = query.shape[1], key.shape[1]
    if hq % cp:
        raise ValueError(
            f"context parallelism splits the query heads: {hq} query heads per TP rank are not divisible by "
            f"context_parallel_size={cp}; use a CP size that divides them"
        )
    r = kv_repeat(hkv, cp)
    if r > 1:
        key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)

    def a2a(x):
        n, h, d = x.shape
        return to_head_shard(x.reshape(n, h * d), cp_group).reshape(n * cp, h // cp, d)

    return a2a(query), a2a(key), a2a(value)


def attention_to_seq_shard(out: torch.Tensor, cp_group) -> torch.Tensor:
    """Attention output `[whole pack, Hq / cp * D]` -> `[shard, Hq * D]`."""
    if _size(cp_group) == 1:
        return out
    return to_seq_shard(out.reshape(out.shape[0], -1), cp_group)


def local_channels(param: torch.Tensor, cp_group, split_sections: Sequence[int]) -> torch.Tensor:
    """The slice of a per-channel parameter (the GDN conv weight / bias over q, k, v channels) that
    belongs to this rank's head shard (megatron's `get_parameter_local_cp`)."""
    if param is None or _size(cp_group) == 1:
        return param
    _, _, get_parameter_local_cp = gdn_cp_collectives()
    return get_parameter_local_cp(param, dim=0, cp_group=cp_group, split_sections=list(split_sections))
