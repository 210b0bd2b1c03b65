"""Step 1 of the layout: decide what is shared (the prefix tree of a micro-batch).

A *prefix tree* over the samples' sequences (prompt + response tokens) is a forest of nodes; a node
is a run of tokens `[start, end)` of its representative sample's sequence, and every sample whose
path passes through the node has those same tokens at those same positions. A sample's path runs
from a root down to its *terminal* node, the node holding its last token (it may end inside that
node: attention inside a node is causal, so the sample just reads the node's first positions).

Three deciders build one:
- `unshared_tree`: every sample its own root (the stock computation, the reference);
- `prompt_tree`: today's one-level sharing: samples with identical prompt tokens share one root
  holding the prompt, each response is a child of its own (depth one);
- `token_trie`: a radix tree over the tokens: sequences share every common prefix, single-child
  chains are merged, nodes are split only where sequences diverge (`min_shared`, `max_depth` and
  share classes limit it).

`token_trie` runs in host time linear in the tokens plus a sort: the sequences are sorted (by the
bytes of their tokens, in C), the longest common prefix of each sorted neighbour pair is found with
numpy in one vectorised pass, and the tree is built from the sorted order and those prefix lengths
with a stack (one step per sample, no per-token Python loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, List, Optional, Sequence, Tuple

import numpy as np


@dataclass
class PrefixTree:
    """Nodes (length N) and each sample's terminal node (length B). Node ids carry no order (the
    pack order is step 2, `ps_bridge.tree.order`)."""

    node_sample: np.ndarray  # [N] the sample whose sequence holds the node's tokens
    node_start: np.ndarray  # [N] first position (in that sequence) of the node
    node_end: np.ndarray  # [N] one past its last position
    node_parent: np.ndarray  # [N] parent node id, -1 for a root
    sample_node: np.ndarray  # [B] the node holding each sample's last token
    # the samples' flattened sequences (flat tokens, offsets [B + 1], prompt lengths [B]) when the
    # tree was decided from samples (`layout.decide_tree`): the layout packs them without flattening again
    sequences: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default=None, repr=False, compare=False)
    # each sample's images (`images.image_signature`) when it was decided from samples with images
    images: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        return int(self.node_start.size)

    @property
    def num_samples(self) -> int:
        return int(self.sample_node.size)

    @property
    def trie_tokens(self) -> int:
        """Tokens stored once each (padding not counted)."""
        return int((self.node_end - self.node_start).sum())


def sequence_offsets(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)


def unshared_tree(lengths: Sequence[int]) -> PrefixTree:
    """Every sample its own root: nothing shared."""
    B = len(lengths)
    ids = np.arange(B, dtype=np.int64)
    return PrefixTree(ids, np.zeros(B, dtype=np.int64), np.asarray(lengths, dtype=np.int64), np.full(B, -1, dtype=np.int64), ids.copy())


def prompt_tree(groups: List[List[int]], prompt_lengths: Sequence[int], lengths: Sequence[int]) -> PrefixTree:
    """One level: group g's prompt is a root (held by its first member), each member's response a
    child of it. `groups`: sample indices per group (identical prompt tokens, `find_groups`)."""
    B = len(lengths)
    G = len(groups)
    sample = np.empty(G + B, dtype=np.int64)
    start = np.empty(G + B, dtype=np.int64)
    end = np.empty(G + B, dtype=np.int64)
    parent = np.empty(G + B, dtype=np.int64)
    sample_node = np.empty(B, dtype=np.int64)
    for g, members in enumerate(groups):
        first = members[0]
        sample[g], start[g], end[g], parent[g] = first, 0, prompt_lengths[first], -1
        for i in members:
            n = G + i
            sample[n], start[n], end[n], parent[n] = i, prompt_lengths[i], lengths[i], g
            sample_node[i] = n
    return PrefixTree(sample, start, end, parent, sample_node)


def _sorted_neighbour_lcp(flat: np.ndarray, offsets: np.ndarray, order: np.ndarray) -> np.ndarray:
    """`lcp[r]` = longest common prefix of sequences `order[r - 1]` and `order[r]` (0 for r = 0),
    in one vectorised pass over at most the tokens of the shorter of each pair."""
    B = order.size
    lcp = np.zeros(B, dtype=np.int64)
    if B < 2:
        return lcp
    a, b = order[:-1], order[1:]
    lengths = np.diff(offsets)
    m = np.minimum(lengths[a], lengths[b])  # >= 1: every sequence has a token
    cum = np.concatenate([[0], np.cumsum(m)])
    within = np.arange(cum[-1], dtype=np.int64) - np.repeat(cum[:-1], m)
    equal = flat[np.repeat(offsets[a], m) + within] == flat[np.repeat(offsets[b], m) + within]
    # first mismatch per pair, or m when none
    first = np.where(equal, np.repeat(m, m), within)
    lcp[1:] = np.minimum.reduceat(first, cum[:-1])
    return lcp


def token_trie(
    flat: np.ndarray,
    offsets: np.ndarray,
    *,
    classes: Optional[Sequence[Hashable]] = None,
    min_shared: int = 0,
    max_depth: Optional[int] = None,
    prompt_lengths: Optional[np.ndarray] = None,
) -> PrefixTree:
    """The radix tree of the sequences `flat[offsets[i]:offsets[i + 1]]`.

    classes: samples of different classes never share a position (e.g. their sampling temperatures:
      a shared position's logits are scaled by one temperature).
    min_shared: a shared run shorter than this is not shared: an inner node shorter than it (and
      where no sample ends) is pushed down into its children, top down (so a one-token root such as
      a BOS token shared by different prompts is dropped, and each child starts at position 0).
      0 shares every common token.
    prompt_lengths: each sample's prompt length. Given, a short node in which the prompts of two or
      more samples with the same prompt end is kept: a whole prompt (or its rest below a shared
      system prompt) shared by its responses, which one level of sharing shares whatever its
      length, so the tree never shares less than one level does (a GRPO group of a short prompt is
      one node with its responses below).
    max_depth: nodes at this depth (roots: 0) have no children: their subtree is replaced by one
      leaf per sample passing through it (0: only samples that are prefixes of one another share,
      identical ones included, each path being one node; 1: one level).
    """
    if min_shared < 0:
        raise ValueError(f"min_shared (the shortest shared run) must be >= 0, got {min_shared}")
    if max_depth is not None and max_depth < 0:
        raise ValueError(f"max_depth (the tree's depth limit) must be >= 0 or None, got {max_depth}")
    lengths = np.diff(offsets)
    B = lengths.size
    big_endian = flat.astype(">i8")  # byte order = token order, so bytes sort like token lists
    if classes is None:
        order = sorted(range(B), key=lambda i: big_endian[offsets[i] : offsets[i + 1]].tobytes())
        class_of = None
    else:
        if len(classes) != B:
            raise ValueError(f"{len(classes)} share classes for {B} samples")
        ids = {c: k for k, c in enumerate(dict.fromkeys(classes))}
        class_of = np.array([ids[c] for c in classes], dtype=np.int64)
        order = sorted(range(B), key=lambda i: (class_of[i], big_endian[offsets[i] : offsets[i + 1]].tobytes()))
    order = np.asarray(order, dtype=np.int64)
    lcp = _sorted_neighbour_lcp(flat, offsets, order)
    if class_of is not None:
        lcp[1:][class_of[order[1:]] != class_of[order[:-1]]] = 0

    # stack construction: `stack` is the path of the previous sequence, each node ending where the
    # next one starts and the deepest ending at the previous sequence's length
    sample: List[int] = []
    start: List[int] = []
    end: List[int] = []
    parent: List[int] = []
    has_child: List[bool] = []

    def new(i, a, b, p):
        sample.append(i), start.append(a), end.append(b), parent.append(p), has_child.append(False)
        if p >= 0:
            has_child[p] = True
        return len(start) - 1

    terminal = np.empty(B, dtype=np.int64)
    stack: List[int] = []
    for i, l in zip(order.tolist(), lcp.tolist()):
        L = int(lengths[i])
        while stack and start[stack[-1]] >= l:
            stack.pop()
        if not stack:
            stack.append(new(i, 0, L, -1))
            terminal[i] = stack[-1]
            continue
        top = stack[-1]
        if end[top] > l:  # the sequences diverge inside `top`: its upper part becomes its parent
            upper = new(sample[top], start[top], l, parent[top])
            parent[top], start[top] = upper, l
            has_child[upper] = True
            stack[-1] = top = upper
        if l == L:  # identical to the path so far
            terminal[i] = top
        elif has_child[top]:
            stack.append(new(i, l, L, top))
            terminal[i] = stack[-1]
        else:  # the previous sequence is a prefix of this one: its leaf grows (no single-child chain)
            end[top], sample[top] = L, i
            terminal[i] = top
    tree = PrefixTree(
        np.asarray(sample, dtype=np.int64), np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64),
        np.asarray(parent, dtype=np.int64), terminal,
    )
    # a sample recorded on a node that was split later ends in one of the node's upper parts
    for i in range(B):
        n = tree.sample_node[i]
        while tree.node_start[n] >= lengths[i]:
            n = tree.node_parent[n]
        tree.sample_node[i] = n
    if min_shared > 0:
        tree = _drop_short_runs(tree, min_shared, prompt_lengths)
    if max_depth is not None:
        tree = _limit_depth(tree, max_depth, lengths)
    return tree


def node_children(tree: PrefixTree) -> List[List[int]]:
    children: List[List[int]] = [[] for _ in range(tree.num_nodes)]
    for n, p in enumerate(tree.node_parent.tolist()):
        if p >= 0:
            children[p].append(n)
    return children


def node_levels(tree: PrefixTree) -> np.ndarray:
    """Depth of every node (roots: 0), top down over the children lists."""
    level = np.zeros(tree.num_nodes, dtype=np.int64)
    children = node_children(tree)
    todo = [n for n in range(tree.num_nodes) if tree.node_parent[n] < 0]
    while todo:
        n = todo.pop()
        for c in children[n]:
            level[c] = level[n] + 1
            todo.append(c)
    return level


def _keep(tree: PrefixTree, keep: np.ndarray) -> PrefixTree:
    """The tree without the nodes not in `keep` (no kept node may point to a dropped one)."""
    new_id = np.full(tree.num_nodes, -1, dtype=np.int64)
    new_id[keep] = np.arange(int(keep.sum()))
    parent = tree.node_parent[keep]
    parent = np.where(parent >= 0, new_id[np.maximum(parent, 0)], -1)
    return PrefixTree(tree.node_sample[keep], tree.node_start[keep], tree.node_end[keep], parent, new_id[tree.sample_node])


def _holds_a_group_prompt_end(tree: PrefixTree, prompt_lengths: np.ndarray) -> np.ndarray:
    """Per node, whether the last prompt token of two or more samples with the same prompt length lies
    in it: samples that pass through one node and end their prompts at the same position there have
    the same prompt, a group that one level of sharing shares."""
    prompts = np.asarray(prompt_lengths, dtype=np.int64).tolist()
    start, parent = tree.node_start.tolist(), tree.node_parent.tolist()
    seen: set = set()
    holds = np.zeros(tree.num_nodes, dtype=bool)
    for n, P in zip(tree.sample_node.tolist(), prompts):
        while start[n] >= P:  # up the sample's path to the node holding position P - 1
            n = parent[n]
        if (n, P) in seen:
            holds[n] = True
        seen.add((n, P))
    return holds


def _drop_short_runs(tree: PrefixTree, min_shared: int, prompt_lengths: Optional[np.ndarray] = None) -> PrefixTree:
    tree = PrefixTree(*(x.copy() for x in (tree.node_sample, tree.node_start, tree.node_end, tree.node_parent, tree.sample_node)))
    children = node_children(tree)
    # kept whatever their length: where a sample ends, and where a group's whole prompt (or its rest
    # below a shared prefix) ends (a dropped node holds no group's prompt end, so moving its run into
    # its children gives them none: this is decided once, here)
    any_length = np.zeros(tree.num_nodes, dtype=bool)
    any_length[tree.sample_node] = True
    if prompt_lengths is not None:
        any_length |= _holds_a_group_prompt_end(tree, prompt_lengths)
    keep = np.ones(tree.num_nodes, dtype=bool)
    todo = [n for n in range(tree.num_nodes) if tree.node_parent[n] < 0]
    while todo:
        n = todo.pop()
        if children[n] and not any_length[n] and tree.node_end[n] - tree.node_start[n] < min_shared:
            keep[n] = False
            for c in children[n]:  # each child holds the run itself
                tree.node_start[c] = tree.node_start[n]
                tree.node_parent[c] = tree.node_parent[n]
        todo.extend(children[n])
    return _keep(tree, keep)


def _limit_depth(tree: PrefixTree, max_depth: int, lengths: np.ndarray) -> PrefixTree:
    level = node_levels(tree)
    children = node_children(tree)
    cut = [n for n in range(tree.num_nodes) if level[n] == max_depth and children[n]]
    if not cut:
        return tree
    # the node at depth max_depth on each sample's path, if it is cut
    cut_of = np.full(tree.num_nodes, -1, dtype=np.int64)
    for n in cut:
        todo = [n]
        while todo:
            m = todo.pop()
            cut_of[m] = n
            todo.extend(children[m])
    keep = cut_of < 0
    kept = _keep(tree, keep)
    new_id = np.full(tree.num_nodes, -1, dtype=np.int64)
    new_id[keep] = np.arange(int(keep.sum()))
    sample, start, end, parent = (list(x) for x in (kept.node_sample, kept.node_start, kept.node_end, kept.node_parent))
    sample_node = kept.sample_node.copy()
    for i in np.nonzero(cut_of[tree.sample_node] >= 0)[0].tolist():  # one leaf per sample below a cut
        c = cut_of[tree.sample_node[i]]
        p = tree.node_parent[c]
        sample.append(i), start.append(tree.node_start[c]), end.append(int(lengths[i]))
        parent.append(new_id[p] if p >= 0 else -1)
        sample_node[i] = len(start) - 1
    as_array = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return PrefixTree(as_array(sample), as_array(start), as_array(end), as_array(parent), sample_node)
