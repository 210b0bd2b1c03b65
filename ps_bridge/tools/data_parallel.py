"""Whole prompt groups (or whole subtrees of a prefix tree) across the data-parallel ranks, and the
rows back on one rank.

Expert parallelism (EP) takes its ranks out of the data-parallel (DP) ranks: EP=2 on 2 processes is
DP=2, each rank running its own micro-batch while the experts exchange tokens. A group (one prompt
and its responses) stays on one rank, or its prompt would be computed twice: `dp_share` gives each
DP rank whole groups (by identical prompt tokens, in order of first appearance, dealt out by token
count), `gather_rows` puts every sample's rows back in input order on DP rank 0.

Prefix trees (`PrefixSharingConfig.tree`): each rank gets whole subtrees of the micro-batch's token
trie (`split_subtrees`). A subtree larger than a rank's share of the trie tokens (a root shared by
the whole batch, such as a system prompt) is split into its children's subtrees, its own tokens then
computed on each rank that holds part of it (each rank's own layout shares them among its samples);
the MoE token weights stay exact (a rank weights a position by its own samples through it, the
ranks' weights add up to the whole batch's) and the gradients are summed over the ranks.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ps_bridge.layout import Sample, decide_tree
from ps_bridge.tools.schedule import logprob_pass
from ps_bridge.tree.decide import PrefixTree, node_children


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


def split_subtrees(tree: PrefixTree, dp_size: int) -> List[List[int]]:
    """Sample indices per DP rank: whole subtrees of `tree` (`layout.decide_tree`), every rank at least
    one. Units start as the roots' subtrees; while there are fewer units than ranks, or the largest
    unit that can be split holds more than `trie tokens / dp_size` below its top, it is split into its children's
    subtrees (plus, as one unit, the samples ending in its root node); still fewer units than ranks,
    the samples ending in one node (identical, or prefixes of one another) part. Largest unit first, each goes
    to the rank where it adds the fewest tokens on top of that rank's load (its ancestors already
    there cost nothing), the first `dp_size` units one per rank. Host integers only: every rank
    computes the same split."""
    children = node_children(tree)
    parent = tree.node_parent.tolist()
    tokens = (tree.node_end - tree.node_start).tolist()
    ends_at: List[List[int]] = [[] for _ in range(tree.num_nodes)]
    for i, n in enumerate(tree.sample_node.tolist()):
        ends_at[n].append(i)
    below = list(tokens)  # tokens of each node's subtree
    order = _top_down(children, parent)
    for n in reversed(order):
        if parent[n] >= 0:
            below[parent[n]] += below[n]

    def ancestors(n) -> List[int]:
        path = []
        while n >= 0:
            path.append(n)
            n = parent[n]
        return path

    # a unit: (its root node, the samples ending there, or None for the whole subtree below it); its
    # nodes: the root's path up, plus the subtree below the root when whole
    units = [(n, None) for n in order if parent[n] < 0]
    target = sum(tokens) / dp_size

    def size(unit) -> int:  # its own tokens: its subtree's, or its node's (ancestors not counted)
        n, ending = unit
        return below[n] if ending is None else tokens[n]

    while True:
        splittable = [u for u in units if u[1] is None and children[u[0]]]
        if not splittable:
            break
        largest = max(splittable, key=size)  # the first of equal sizes
        if len(units) >= dp_size and size(largest) <= target:
            break
        k = units.index(largest)
        n = largest[0]
        units[k : k + 1] = ([(n, tuple(ends_at[n]))] if ends_at[n] else []) + [(c, None) for c in children[n]]
    units = [(n, tuple(ends_at[n])) if ending is None and not children[n] else (n, ending) for n, ending in units]
    while len(units) < dp_size:  # last resort: samples ending in one node (one a prefix of another) apart
        several = [k for k, (_, ending) in enumerate(units) if ending is not None and len(ending) > 1]
        if not several:
            break
        n, ending = units[several[0]]
        units[several[0] : several[0] + 1] = [(n, (i,)) for i in ending]
    if len(units) < dp_size:
        raise ValueError(
            f"the micro-batch's {tree.num_samples} sample(s) split into {len(units)} part(s) of its prefix tree, "
            f"fewer than the {dp_size} data-parallel ranks (each needs a sample; with expert parallelism the "
            "data-parallel size is world / (tp x pp)): give the batch more samples or launch fewer processes"
        )

    def subtree(n) -> List[int]:
        out, todo = [], [n]
        while todo:
            m = todo.pop()
            out.append(m)
            todo.extend(children[m])
        return out

    def nodes_of(unit) -> List[int]:
        n, ending = unit
        return ancestors(n) + (subtree(n)[1:] if ending is None else [])

    def samples_of(unit) -> List[int]:
        n, ending = unit
        return list(ending) if ending is not None else [i for m in subtree(n) for i in ends_at[m]]

    held: List[set] = [set() for _ in range(dp_size)]
    load = [0] * dp_size
    shares: List[List[int]] = [[] for _ in range(dp_size)]
    for k, unit in enumerate(sorted(units, key=size, reverse=True)):  # stable: equal sizes in tree order
        nodes = nodes_of(unit)

        def added(r):
            return sum(tokens[m] for m in nodes if m not in held[r])

        rank = k if k < dp_size else min(range(dp_size), key=lambda r: (load[r] + added(r), r))
        load[rank] += added(rank)
        held[rank].update(nodes)
        shares[rank].extend(samples_of(unit))
    return [sorted(s) for s in shares]


def _top_down(children: List[List[int]], parent: List[int]) -> List[int]:
    """Node ids, every parent before its children, roots in id order."""
    order = [n for n in range(len(parent)) if parent[n] < 0]
    k = 0
    while k < len(order):
        order.extend(children[order[k]])
        k += 1
    return order


def dp_group_and_rank():
    return parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_rank()


def dp_share(samples: Sequence[Sample], tree_options: Optional[dict] = None) -> Tuple[List[int], List[Sample]]:
    """This DP rank's sample indices and samples (all of them without data parallelism): whole prompt
    groups, or with `tree_options` (`decide_tree`'s `min_shared` / `max_depth`) whole subtrees of
    the micro-batch's prefix tree."""
    group, rank = dp_group_and_rank()
    size = dist.get_world_size(group)
    if size == 1:
        return list(range(len(samples))), list(samples)
    indices = dp_parts(samples, size, tree_options)[rank]
    return indices, [samples[i] for i in indices]


def dp_parts(samples: Sequence[Sample], dp_size: int, tree_options: Optional[dict] = None) -> List[List[int]]:
    """Every DP rank's sample indices (`dp_share`'s split, rank by rank)."""
    if tree_options is None:
        return split_groups(samples, dp_size)
    return split_subtrees(decide_tree(samples, "tree", **tree_options), dp_size)


def tree_options_of(config, share) -> Optional[dict]:
    """`dp_share`'s `tree_options` for a run with this `PrefixSharingConfig` and `share` (None: the
    rule decides, on each rank's part): a tree's options where the shared packing is a prefix tree."""
    if config.layout_share(config.enabled if share is None else share) != "tree":
        return None
    return dict(min_shared=config.tree_min_shared, max_depth=config.tree_max_depth)


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
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_data_parallel_world_size()


def dp_logprob_pass(loaded, micro_batches, share=None, loss_weights=None):
    """`schedule.logprob_pass` with each micro-batch's whole groups (whole subtrees for a prefix tree)
    split across the data-parallel
    ranks (every rank runs every micro-batch, each its share), the gradients summed over them
    (`parallel.finish_gradients`, at the end of the pass), and every sample's rows in input order on
    data-parallel rank 0 (None elsewhere)."""
    tree_options = tree_options_of(loaded.config, share)
    parts = [dp_share(mb, tree_options) for mb in micro_batches]
    weights = None
    if loss_weights is not None:
        weights = [[loss_weights[k][i] for i in idx] for k, (idx, _) in enumerate(parts)]
    rows = logprob_pass(loaded, [mine for _, mine in parts], share=share, loss_weights=weights)
    gathered = [gather_rows(idx, r, len(mb)) for (idx, _), r, mb in zip(parts, rows, micro_batches)]
    return None if gathered[0] is None else gathered
