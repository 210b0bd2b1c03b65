"""Rank tags for the `[PS]` log lines, so a user can see that every rank took the path."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state


def _rank_size(group):
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def rank_tag(pg_collection=None) -> str:
    global_rank = dist.get_rank() if dist.is_initialized() else 0
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if tp is None and dist.is_initialized():
        try:
            tp = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
            cp = parallel_state.get_context_parallel_group(check_initialized=False)
        except Exception:  # parallel state not initialised: plain torch.distributed
            tp = cp = None
    tp_rank, tp_size = _rank_size(tp)
    cp_rank, cp_size = _rank_size(cp)
    return f"global_rank={global_rank} tp_rank={tp_rank}/tp_size={tp_size} cp_rank={cp_rank}/cp_size={cp_size}"
