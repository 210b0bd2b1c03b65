"""Step 2 of the layout: the order of the pack (which node goes where).

Nodes are packed level by level (all roots, then all their children, ...), depth first inside a
level: each level's nodes form one contiguous varlen block (a Gated DeltaNet call per level, a
cascade attention launch per level), and inside it the descendants of any node come in one run.
Siblings are ordered by the first sample (input order) in their subtree, so a one-level tree packs
exactly as before: prompts in order of first appearance, then the responses group by group.

Depth-first intervals: `tin[n]` is node n's index in a depth-first pre-order walk, `tout[n]` one
past the last of its subtree's, so node a is an ancestor of n (or n itself) iff
`tin[a] <= tin[n] < tout[a]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np

from ps_bridge.tree.decide import PrefixTree, node_children


@dataclass
class PackOrder:
    """`nodes[k]`: the node at pack index k; `pack_index[n]`: node n's pack index (the inverse). Per
    pack index: level, parent (pack index, -1 for a root), tin, tout. `level_offsets`: cumulative node
    counts per level (`[0, roots, ...]`)."""

    nodes: np.ndarray
    pack_index: np.ndarray
    level: np.ndarray
    parent: np.ndarray
    tin: np.ndarray
    tout: np.ndarray
    level_offsets: List[int]

    @property
    def depth(self) -> int:
        """The tree's depth: 0 when nothing is shared below a root (every sample its own root)."""
        return len(self.level_offsets) - 2


def pack_order(tree: PrefixTree) -> PackOrder:
    N = tree.num_nodes
    children = node_children(tree)
    # first sample of each subtree, deepest nodes first (a node's children come after it in `walk`)
    first = np.full(N, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, tree.sample_node, np.arange(tree.num_samples, dtype=np.int64))
    roots = [n for n in range(N) if tree.node_parent[n] < 0]
    walk: List[int] = []
    todo = list(roots)
    while todo:
        n = todo.pop()
        walk.append(n)
        todo.extend(children[n])
    for n in reversed(walk):
        p = tree.node_parent[n]
        if p >= 0 and first[n] < first[p]:
            first[p] = first[n]
    # depth-first pre-order, siblings by their first sample
    tin = np.empty(N, dtype=np.int64)
    tout = np.empty(N, dtype=np.int64)
    level = np.empty(N, dtype=np.int64)
    counter = 0
    todo = [(n, 0, False) for n in sorted(roots, key=lambda n: first[n], reverse=True)]
    while todo:
        n, depth, leaving = todo.pop()
        if leaving:
            tout[n] = counter
            continue
        tin[n], level[n] = counter, depth
        counter += 1
        todo.append((n, depth, True))
        todo.extend((c, depth + 1, False) for c in sorted(children[n], key=lambda c: first[c], reverse=True))
    nodes = np.lexsort((tin, level))  # level by level, depth first inside a level
    pack_index = np.empty(N, dtype=np.int64)
    pack_index[nodes] = np.arange(N)
    parent = tree.node_parent[nodes]
    parent = np.where(parent >= 0, pack_index[np.maximum(parent, 0)], -1)
    counts = np.bincount(level, minlength=1)
    level_offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    return PackOrder(nodes=nodes, pack_index=pack_index, level=level[nodes], parent=parent, tin=tin[nodes],
                     tout=tout[nodes], level_offsets=level_offsets)
