"""The micro-batch as a prefix tree: the layout's first two steps, each testable alone.

- `decide.py`: what is shared (`PrefixTree`: `unshared_tree`, `prompt_tree`, `token_trie`);
- `order.py`: the order of the pack (`pack_order`: level by level, depth first inside a level, and
  the depth-first intervals).

The third step, the tensors of the pack and the way back, is `ps_bridge.layout.materialize`;
`ps_bridge.layout.build_layout` runs the three.
"""
