"""Compatibility shims for running the Megatron stack where parts of it are absent.

Each shim lives in its own module and is a no-op where the real thing is present:
- `te_placeholder`: import `megatron.bridge` without Transformer Engine installed.
- `cuda_on_cpu`: route megatron-core's hard-coded CUDA calls to the CPU when CUDA is absent.
"""
