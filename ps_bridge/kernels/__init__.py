"""Kernels of prefix sharing, one package per op, each with a plain reference backend.

- `attention`: prefix-shared causal softmax attention over a packed layout.
- `gdn`: Gated DeltaNet with the prompt's states forked into its responses (Qwen3.5).
"""
