"""Random micro-batches shaped like prefix trees (for the tree tests).

A system prompt shared across prompts (or not), nodes of 1 to 3 tokens between long ones, depth up
to 4 (a system prompt above branches 3 deep), samples ending at a node's end or inside it (a sample whose whole sequence is a prefix of
another's), identical samples; each sample's prompt/response split at a random point.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import List

from ps_bridge.layout import Sample


def tree_samples(seed: int, vocab: int = 16, max_depth: int = 3, max_samples: int = 24) -> List[Sample]:
    rng = random.Random(seed)
    seqs: List[List[int]] = []

    def emit(seq):
        if len(seq) >= 2 and len(seqs) < max_samples:
            seqs.append(list(seq))

    def grow(prefix, depth):
        n = rng.randint(1, 3) if rng.random() < 0.5 else rng.randint(6, 12)
        seq = prefix + [rng.randrange(vocab) for _ in range(n)]
        children = rng.randint(0, 3) if depth < max_depth else 0
        if children == 0 or rng.random() < 0.4:
            emit(seq)
            if rng.random() < 0.2:
                emit(seq)  # identical samples
        if len(seq) >= 3 and rng.random() < 0.3:
            emit(seq[: rng.randint(2, len(seq) - 1)])  # ends inside this node
        for _ in range(children):
            grow(seq, depth + 1)

    system = [rng.randrange(vocab) for _ in range(rng.randint(6, 12))] if rng.random() < 0.7 else []
    for _ in range(rng.randint(1, 3)):
        grow(list(system), 0)
    if not seqs:
        emit(system + [1, 2])
    rng.shuffle(seqs)
    out = []
    for seq in seqs:
        p = rng.randint(1, len(seq) - 1)
        out.append(Sample(seq[:p], seq[p:]))
    return out


def distinct_prefixes(samples: List[Sample]) -> Counter:
    """How many samples pass through each distinct prefix (the trie's tokens are its keys)."""
    counts: Counter = Counter()
    for s in samples:
        seq = tuple(s.prompt) + tuple(s.response)
        for t in range(len(seq)):
            counts[seq[: t + 1]] += 1
    return counts


def count_trie_builds(monkeypatch) -> list:
    """Patch the token trie (`ps_bridge.tree.decide.token_trie`, and the name `ps_bridge.layout` imported)
    to append to the returned list at every build."""
    import ps_bridge.layout as layout_module
    import ps_bridge.tree.decide as decide_module

    built: list = []
    real = decide_module.token_trie

    def counted(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(decide_module, "token_trie", counted)
    monkeypatch.setattr(layout_module, "token_trie", counted)
    return built
