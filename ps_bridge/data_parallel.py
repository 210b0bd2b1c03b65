"""Whole prompt groups across the data-parallel ranks, and the rows back on one rank.

Expert parallelism (EP) takes its ranks out of the data-parallel (DP) ranks: EP=2 on 2 processes is
DP=2, each rank running its own micro-batch while the experts exchange tokens. A group (one prompt
and its responses) must stay on one rank, or its prompt would be computed twice and its responses
would miss their prompt: `dp_share` gives each DP rank whole groups (by identical prompt tokens, in
order of first appearance, dealt out by token count), `gather_rows` puts every sample's rows back
in input order on DP rank 0.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ps_bridge.layout import Sample


def _groups(samples: Sequence[Sample]) -> List[List[int]]:
    by_prompt: Dict[Tuple[int, ...], List[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(tuple(s.prompt), []).append(i)
    return list(by_prompt.values())


def split_groups(samples: Sequence[Sample], dp_size: int) -> List[List[int]]:
    """Sample indices per DP rank: whole groups, the next group to the rank with the fewest tokens."""
    groups = _groups(samples)
    if len(groups) < dp_size:
        raise ValueError(
            f"{len(groups)} prompt group(s) cannot be split across {dp_size} data-parallel ranks (each rank needs a "
            f"whole group; with expert parallelism the data-parallel size is world / (tp x pp) = {dp_size}): "
            "give the batch more prompts or launch fewer processes"
        )
    shares: List[List[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for group in groups:
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        shares[rank].extend(group)
        load[rank] += sum(len(samples[i].prompt) + len(samples[i].response) for i in group)
    return [sorted(s) for s in shares]


def dp_group_and_rank():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_rank()


def dp_share(samples: Sequence[Sample]) -> Tuple[List[int], List[Sample]]:
    """This DP rank's sample indices and samples (all of them without data parallelism)."""
    group, rank = dp_group_and_rank()
    size = dist.get_world_size(group)
    if size == 1:
        return list(range(len(samples))), list(samples)
    indices = split_groups(samples, size)[rank]
    return indices, [samples[i] for i in indices]


def gather_rows(indices: Sequence[int], rows: Sequence[torch.Tensor], num_samples: int):
    """Every DP rank's `(indices, rows)` gathered into input order on DP rank 0 (None elsewhere)."""
    group, rank = dp_group_and_rank()
    size = dist.get_world_size(group)
    if size == 1:
        return list(rows)
    mine = (list(indices), [r.detach().float().cpu() for r in rows])
    box = [None] * size if rank == 0 else None
    dist.gather_object(mine, box, dst=dist.get_global_rank(group, 0), group=group)
    if rank != 0:
        return None
    out: List[torch.Tensor] = [None] * num_samples  # type: ignore[list-item]
    for idx, rs in box:
        for i, r in zip(idx, rs):
            out[i] = r
    return out


def data_parallel_size() -> int:
    """The data-parallel size (without context parallelism); 1 before megatron's groups exist."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_data_parallel_world_size()


def dp_logprob_pass(loaded, micro_batches, share=None, loss_weights=None):
    """`schedule.logprob_pass` with each micro-batch's whole groups split across the data-parallel
    ranks (every rank runs every micro-batch, each its share), the gradients summed over them
    (`parallel.finish_gradients`, at the end of the pass), and every sample's rows in input order on
    data-parallel rank 0 (None elsewhere)."""
    from ps_bridge.schedule import logprob_pass

    parts = [dp_share(mb) for mb in micro_batches]
    weights = None
    if loss_weights is not None:
        weights = [[loss_weights[k][i] for i in idx] for k, (idx, _) in enumerate(parts)]
    rows = logprob_pass(loaded, [mine for _, mine in parts], share=share, loss_weights=weights)
    gathered = [gather_rows(idx, r, len(mb)) for (idx, _), r, mb in zip(parts, rows, micro_batches)]
    return None if gathered[0] is None else gathered
