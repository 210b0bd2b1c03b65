"""The micro-batch as a prefix tree: the layout's three steps, one a file, each testable alone.

- `decide.py`: what is shared (`PrefixTree`: `unshared_tree`, `prompt_tree`, `token_trie`);
- `order.py`: the order of the pack (`pack_order`: level by level, depth first inside a level, and
  the depth-first intervals);
- `materialize.py`: the tensors of the pack and the way back (`materialize`: a
  `ps_bridge.layout.PackedPrefixLayout`).

`ps_bridge.layout.build_layout` checks the samples and runs the three.
"""
