"""Compatibility shims for running the Megatron stack where parts of it are absent.

Each shim lives in its own module and is a no-op where the real thing is present:
- `te_placeholder`: import `megatron.bridge` without Transformer Engine installed.
- `cuda_on_cpu`: route megatron-core's hard-coded CUDA calls to the CPU when CUDA is absent.
- `verl_on_cpu`: run verl's own Megatron engine on a CPU (absent-module placeholders, a CPU platform).
- `verl`: what differs between the verl releases the engine runs on (0.8.0, 0.9.1), by what verl offers.
- `quiet`: third-party import notices and progress prints silenced unless `-v`.

And one adapter per dependency for what differs between the tested releases (docs/install.md):
- `megatron_core`: megatron-core 0.18.0 - 0.19.2.
- `megatron_bridge`: Megatron-Bridge 0.5.0 - 0.6.2.
- `verl`: verl 0.8.0 - 0.9.1 (above).
- `fla`: fla-core 0.4.2 - 0.6.0.
- `torch`: torch 2.9.1 - 2.14.1.
- `triton`: the Triton releases that compute fla's Hopper GDN backward wrongly.
- `flash_attn`: flash-attn 2.x's varlen keyword lists.
Models, providers, kernels and the engine call these and never read a version or probe a
dependency for a symbol themselves (tests/test_compat_version_probes.py checks it).
"""
