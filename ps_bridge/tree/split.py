"""A prefix tree's samples in micro-batches within a token budget, each shared prefix kept in as few of
them as the budget allows (steps 2 and 3 of `ps_bridge.verl.micro_batches`, which adds verl's side:
the count agreed over data-parallel ranks, verl's order). Used by the verl engine's micro-batching and
by `ps-bridge bench` where a shared micro-batch does not fit at once.

- `PackedCosts` (`packed_costs` from the tree and its pack order, steps 1 and 2 of the layout, or
  `layout_costs` from a built layout): what the split reads of a packed tree, each node's padded length
  and place in the tree (the micro-batching needs no materialized tensors);
- `subtree_units`: a subtree that fits the budget with the path above it is one unit; a larger one
  is split into its children's subtrees and the samples ending in its root, each part carrying the
  path above it (computed once in every micro-batch holding a part: exact, less shared);
- `first_fit_decreasing`: units, largest first, into the first micro-batch where the nodes they
  add fit; `split_to_count`: more micro-batches where a count is imposed;
- `budget_micro_batches`: the sample indices of each micro-batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

import numpy as np

from ps_bridge.packed_layout import PackedPrefixLayout
from ps_bridge.tree.decide import PrefixTree
from ps_bridge.tree.order import PackOrder

logger = logging.getLogger("ps_bridge")

_warned: set = set()


def warn_once(key: str, message: str, *args) -> None:
    """Log `message` the first time `key` is seen in this process (`_warned`)."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _round_up(x, m: int):
    return -(-x // m) * m


# ---- what the split reads of a packed tree ----------------------------------------------------------


@dataclass
class PackedCosts:
    """Per node in pack order: its padded length (`cost`), parent (pack index, -1 for a root) and
    depth-first interval; per sample: its terminal node (pack index), sequence and prompt length."""

    cost: np.ndarray
    parent: np.ndarray
    tin: np.ndarray
    tout: np.ndarray
    terminal: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    pad_multiple: int


def packed_costs(tree: PrefixTree, order: PackOrder, lengths, prompt_lengths, pad_multiple: int = 1) -> PackedCosts:
    """The costs of `tree` packed in `order` with segments padded to `pad_multiple`, as
    `materialize` would pack them (the pack's padding to a total multiple not counted)."""
    nodes = order.nodes
    valid = tree.node_end[nodes] - tree.node_start[nodes]
    return PackedCosts(
        cost=_round_up(valid.astype(np.int64), pad_multiple), parent=np.asarray(order.parent, dtype=np.int64),
        tin=np.asarray(order.tin, dtype=np.int64), tout=np.asarray(order.tout, dtype=np.int64),
        terminal=order.pack_index[tree.sample_node], lengths=np.asarray(lengths, dtype=np.int64),
        prompt_lengths=np.asarray(prompt_lengths, dtype=np.int64), pad_multiple=int(pad_multiple),
    )


def layout_costs(layout: PackedPrefixLayout) -> PackedCosts:
    """The costs of a built layout (its segments as padded, the last one's padding to the pack's total
    multiple included)."""
    return PackedCosts(
        cost=np.asarray(layout.host["padded_lengths"], dtype=np.int64),
        parent=np.asarray(layout.host["segment_parent"], dtype=np.int64),
        tin=layout.segment_tin.cpu().numpy(), tout=layout.segment_tout.cpu().numpy(),
        terminal=layout.sample_segment.cpu().numpy(), lengths=layout.row_offsets.diff().cpu().numpy(),
        prompt_lengths=layout.sample_prompt_length.cpu().numpy(), pad_multiple=int(layout.pad_multiple),
    )


# ---- units: subtrees that fit, each with the path above it ---------------------------------------


@dataclass
class Unit:
    """Samples a micro-batch takes together: the layout's nodes they need (the subtree and the path
    above it) and, for a sample packed on its own, its `private` padded length instead of nodes."""

    samples: List[int]
    nodes: Tuple[int, ...]
    private: int = 0


def subtree_units(packed: Union[PackedCosts, PackedPrefixLayout], budget: int) -> Tuple[List[Unit], np.ndarray]:
    """Units of a packed tree (`PackedCosts`, or a layout) within `budget` packed tokens (the module
    docstring), and each node's cost (its padded length)."""
    c = layout_costs(packed) if isinstance(packed, PackedPrefixLayout) else packed
    cost, parent, tin, tout, terminal = c.cost, c.parent.tolist(), c.tin, c.tout, c.terminal
    by_tin = np.argsort(tin)  # the node at each depth-first index
    cum = np.concatenate([[0], np.cumsum(cost[by_tin])])
    subtree_cost = cum[tout] - cum[tin]
    lengths, prompt = c.lengths, c.prompt_lengths
    own = _round_up(lengths, c.pad_multiple)
    too_long = np.nonzero(own > budget)[0]
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"a sample of {int(lengths[i])} tokens (prompt {int(prompt[i])}) does not fit the micro-batch token "
            f"budget of {budget}: raise actor_rollout_ref.actor.ppo_max_token_len_per_gpu / "
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu / "
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
        )
    sample_order = np.argsort(tin[terminal], kind="stable")
    sample_tin = tin[terminal][sample_order]

    def samples_below(n: int) -> List[int]:
        a, b = np.searchsorted(sample_tin, [tin[n], tout[n]])
        return sorted(sample_order[a:b].tolist())

    children: List[List[int]] = [[] for _ in parent]
    for n, p in enumerate(parent):
        if p >= 0:
            children[p].append(n)
    ends_in: List[List[int]] = [[] for _ in parent]
    for i, n in enumerate(terminal.tolist()):
        ends_in[n].append(i)
    units: List[Unit] = []
    todo = [(n, ()) for n in range(len(parent)) if parent[n] < 0]
    while todo:
        n, path = todo.pop()
        above = int(cost[list(path)].sum())
        if above + subtree_cost[n] <= budget:
            units.append(Unit(samples_below(n), path + tuple(by_tin[tin[n]:tout[n]].tolist())))
            continue
        below = samples_below(n)
        warn_once(
            "budget",
            "[PS][prepare] %d samples below a shared prefix hold %d packed tokens, more than the micro-batch budget "
            "%d: they are split across micro-batches (the prefix is computed once in each; results stay exact, "
            "less is shared); raise the *_max_token_len_per_gpu settings to keep them together",
            len(below), above + int(subtree_cost[n]), budget,
        )
        if above + cost[n] > budget:  # not even the path through n fits: each sample below it on its own
            units.extend(Unit([i], (), int(own[i])) for i in below)
            continue
        if ends_in[n]:
            units.append(Unit(ends_in[n], path + (n,)))
        todo.extend((c, path + (n,)) for c in children[n])
    return units, cost


# ---- first-fit decreasing, the count agreed over data-parallel ranks --------------------------------


def bin_tokens(units: Sequence[Unit], members: Sequence[int], cost: np.ndarray) -> int:
    """Packed tokens of a micro-batch holding `members` (unit indices): each node once."""
    nodes = set().union(*(units[u].nodes for u in members)) if members else set()
    return int(cost[list(nodes)].sum()) + sum(units[u].private for u in members)


def first_fit_decreasing(units: Sequence[Unit], cost: np.ndarray, budget: int) -> List[List[int]]:
    """Unit indices per micro-batch: each unit, largest first, into the first micro-batch where the
    nodes it adds (those the micro-batch does not hold yet) fit the budget."""
    alone = [bin_tokens(units, [u], cost) for u in range(len(units))]
    bins: List[Tuple[set, List[int]]] = []
    tokens: List[int] = []
    for u in sorted(range(len(units)), key=lambda u: (-alone[u], u)):
        for b, (nodes, members) in enumerate(bins):
            extra = int(sum(int(cost[n]) for n in units[u].nodes if n not in nodes)) + units[u].private
            if tokens[b] + extra <= budget:
                nodes.update(units[u].nodes)
                members.append(u)
                tokens[b] += extra
                break
        else:
            bins.append((set(units[u].nodes), [u]))
            tokens.append(alone[u])
    return [members for _, members in bins]


def split_to_count(units: List[Unit], bins: List[List[int]], k: int, cost: np.ndarray) -> List[List[int]]:
    """`bins` split until there are `k` (every bin stays within its budget: a part holds a subset of
    its nodes): the largest splittable bin gives half its units to a new bin, or, holding one unit,
    half that unit's samples. Needs at least `k` samples in all."""
    bins = [list(b) for b in bins]
    while len(bins) < k:
        splittable = [b for b in bins if len(b) > 1 or len(units[b[0]].samples) > 1]
        b = max(splittable, key=lambda members: bin_tokens(units, members, cost))
        if len(b) > 1:
            bins.append(b[1::2])
            del b[1::2]
        else:
            unit = units[b[0]]
            half = len(unit.samples) // 2
            units[b[0]] = Unit(unit.samples[:half], unit.nodes, unit.private)
            units.append(Unit(unit.samples[half:], unit.nodes, unit.private))
            bins.append([len(units) - 1])
    return bins


def budget_micro_batches(packed: Union[PackedCosts, PackedPrefixLayout], budget: int) -> List[List[int]]:
    """The samples of a packed tree (indices, sorted) in micro-batches of at most `budget` packed
    tokens each (first-fit decreasing over subtree units)."""
    units, cost = subtree_units(packed, budget)
    bins = first_fit_decreasing(units, cost, budget)
    return [sorted(i for u in members for i in units[u].samples) for members in bins]
