"""Kernels of prefix sharing, one package per op, each with a plain reference backend.

- `attention`: prefix-shared causal softmax attention over a packed layout.
- `gdn`: Gated DeltaNet with the prompt's states forked into its responses (Qwen3.5).
- `vocab_softmax`: fused Triton passes of the rows' log-probs over the vocabulary (CUDA; the torch
  reference is in `ps_bridge.rows`).
- `rms_norm`, `row_norm`: Qwen3.5's norms over the last dimension, plain and as one Triton kernel each
  way (CUDA; `row_norm` serves Gated DeltaNet's l2 norm of q and k too).

Each package has one module per design or backend and a `registry.py` of backends by name (records
of the shape in `backend.py`), with `auto` among them; its `__init__.py` only re-exports.
"""
