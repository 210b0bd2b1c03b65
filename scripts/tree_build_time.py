"""Host time of building a prefix-tree layout (CPU), at the bench's largest rows and the issue's tree
shapes, and whether it grows linearly in the tokens.

For each shape: the micro-batch's samples (random token ids), then the best of `--repeat` runs of
the three layout steps (`decide_tree`: flatten + token trie; `pack_order`; `materialize`) and of the
whole `build_layout(share="tree")`; then the same shape with every count of samples doubled and
quadrupled (x2, x4 tokens): linear means the time per token stays flat.

    PYTHONPATH=. python scripts/tree_build_time.py [--repeat 5]

Figures in docs/tree.md ("Host cost").
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Callable, Dict, List

import numpy as np

from ps_bridge.layout import Sample, _flatten, build_layout, decide_tree
from ps_bridge.tree.materialize import materialize
from ps_bridge.tree.order import pack_order


def _ids(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(150_000) for _ in range(n)]


def grpo(P: int, R: int, n: int, groups: int, scale: int = 1) -> Callable[[int], List[Sample]]:
    """`groups * scale` prompts of P tokens, n responses of R each (the bench's one-level rows)."""

    def make(seed):
        rng = random.Random(seed)
        out = []
        for _ in range(groups * scale):
            prompt = _ids(rng, P)
            out += [Sample(prompt, _ids(rng, R)) for _ in range(n)]
        return out

    return make


def system(scale: int = 1) -> Callable[[int], List[Sample]]:
    """A system prompt of 4096 shared by 16 prompts of 256, n = 8, R = 512 (x scale prompts)."""

    def make(seed):
        rng = random.Random(seed)
        head = _ids(rng, 4096)
        out = []
        for _ in range(16 * scale):
            prompt = head + _ids(rng, 256)
            out += [Sample(prompt, _ids(rng, 512)) for _ in range(8)]
        return out

    return make


def chain(scale: int = 1) -> Callable[[int], List[Sample]]:
    """A prompt of 2048 shared by 4 trajectories (x scale), each 8 turns of observation 512 + response
    256, each turn a sample whose prompt is the trajectory so far."""

    def make(seed):
        rng = random.Random(seed)
        head = _ids(rng, 2048)
        out = []
        for _ in range(4 * scale):
            so_far = list(head)
            for _ in range(8):
                so_far += _ids(rng, 512)
                response = _ids(rng, 256)
                out.append(Sample(list(so_far), response))
                so_far += response
        return out

    return make


def search(scale: int = 1) -> Callable[[int], List[Sample]]:
    """A prompt of 2048 (x scale prompts), a tree of depth 3, branching 4, nodes of 1024, a sample per
    node (its prompt: the path above it, its response: the node)."""

    def make(seed):
        rng = random.Random(seed)
        out = []
        for _ in range(scale):
            frontier = [_ids(rng, 2048)]
            for _ in range(3):
                nxt = []
                for path in frontier:
                    for _ in range(4):
                        node = _ids(rng, 1024)
                        out.append(Sample(list(path), node))
                        nxt.append(path + node)
                frontier = nxt
        return out

    return make


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(samples: List[Sample], repeat: int) -> Dict[str, float]:
    tree = decide_tree(samples, "tree", min_shared=0)
    order = pack_order(tree)
    flat, offsets, prompt_lengths = _flatten(samples, None)
    layout = build_layout(samples, share="tree", min_shared=0)
    return dict(
        samples=len(samples),
        tokens=int(offsets[-1]),
        trie_tokens=tree.trie_tokens,
        nodes=tree.num_nodes,
        depth=order.depth,
        decide_s=best_of(repeat, lambda: decide_tree(samples, "tree", min_shared=0)),
        order_s=best_of(repeat, lambda: pack_order(tree)),
        materialize_s=best_of(repeat, lambda: materialize(flat, offsets, prompt_lengths, tree, order, shared=True,
                                                          prompt_values=False)),
        build_layout_s=best_of(repeat, lambda: build_layout(samples, share="tree", min_shared=0, prompt_values=False)),
        layout_tokens=layout.num_tokens,
    )


SHAPES = {
    "grpo (4096, 256, 16), 1 prompt": lambda k: grpo(4096, 256, 16, 1, k),
    "grpo (4096, 256, 16), 16 prompts": lambda k: grpo(4096, 256, 16, 16, k),
    "system": system,
    "chain": chain,
    "search": search,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--scales", default="1,2,4", help="sample-count multipliers (linearity)")
    args = parser.parse_args()
    scales = [int(x) for x in args.scales.split(",")]
    print(f"{'shape':34} {'x':>2} {'samples':>7} {'tokens':>9} {'trie':>8} {'nodes':>6} {'depth':>5} "
          f"{'decide ms':>9} {'order ms':>8} {'mater. ms':>9} {'build ms':>8} {'ns/token':>8}")
    for name, shape in SHAPES.items():
        for k in scales:
            r = measure(shape(k)(0), args.repeat)
            print(f"{name:34} {k:>2} {r['samples']:>7} {r['tokens']:>9} {r['trie_tokens']:>8} {r['nodes']:>6} "
                  f"{r['depth']:>5} {1e3 * r['decide_s']:>9.1f} {1e3 * r['order_s']:>8.1f} "
                  f"{1e3 * r['materialize_s']:>9.1f} {1e3 * r['build_layout_s']:>8.1f} "
                  f"{1e9 * r['build_layout_s'] / r['tokens']:>8.1f}")


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
