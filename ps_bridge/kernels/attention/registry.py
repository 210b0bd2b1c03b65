"""The prefix-shared attention backends by name, and the `auto` choice.

Each backend is called as `backend(q, k, v, layout, softmax_scale)`. `auto` is an entry like the
others; it picks a backend per call with `choose_attention_backend` (see `resolve_attention_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import torch

from ps_bridge.kernels.attention.cascade import prefix_shared_attention_cascade
from ps_bridge.kernels.attention.expand import prefix_shared_attention_expand
from ps_bridge.kernels.attention.flex import prefix_shared_attention_flex
from ps_bridge.kernels.attention.npu import prefix_shared_attention_npu
from ps_bridge.kernels.attention.torch_ref import prefix_shared_attention_torch_ref
from ps_bridge.kernels.attention.varlen import FLASH_DTYPES, flash_takes
from ps_bridge.kernels.backend import AUTO, Backend, lookup
from ps_bridge.layout import PackedPrefixLayout

OP = "prefix-sharing attention"


@dataclass(frozen=True)
class AttentionBackend(Backend):
    """attention: `(q [T, Hq, D], k, v [T, Hkv, D], layout, softmax_scale) -> out [T, Hq, D]`."""

    attention: Callable[..., torch.Tensor]

    def __call__(self, q, k, v, layout: PackedPrefixLayout, softmax_scale: float) -> torch.Tensor:
        return self.attention(q, k, v, layout, softmax_scale)


def choose_attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """`auto`'s choice: the cascade where the CUDA flash kernels take the inputs (fp16/bf16, a head
    dim that is a multiple of 8 up to 256), else the reference (CPU, float32 exactness runs). The
    cascade copies no key/value and was fastest or within a few percent of the fastest in the
    measurements (docs/design.md section 4, BENCHMARKS.md)."""
    return "flash_atten_gpu" if flash_takes(device, dtype, head_dim) else "torch_ref"


def _auto(q, k, v, layout: PackedPrefixLayout, softmax_scale: float) -> torch.Tensor:
    return resolve_attention_backend(AUTO, q)(q, k, v, layout, softmax_scale)


BACKENDS: Dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend(
            "torch_ref", "dense masked softmax per group in plain PyTorch; exact, the reference",
            None, None, prefix_shared_attention_torch_ref,
        ),
        AttentionBackend(
            "flash_atten_gpu", "cascade of varlen flash calls, no key/value copies (CPU: torch's CPU op, for tests)",
            ("cuda", "cpu"), FLASH_DTYPES, prefix_shared_attention_cascade,
        ),
        AttentionBackend(
            "flash_atten_gpu_expand", "one varlen flash call over gathered [prompt; response] keys/values",
            ("cuda", "cpu"), FLASH_DTYPES, prefix_shared_attention_expand,
        ),
        AttentionBackend(
            "flex", "FlexAttention with a prefix-sharing block mask (compiled on CUDA, eager elsewhere)",
            None, None, prefix_shared_attention_flex,
        ),
        AttentionBackend(
            "flash_atten_npu", "the expand design on torch_npu's npu_fusion_attention; UNVERIFIED (no NPU here)",
            ("npu",), None, prefix_shared_attention_npu,
        ),
        AttentionBackend(AUTO, "flash_atten_gpu where the flash kernels take the inputs, else torch_ref", None, None, _auto),
    )
}


def get_attention_backend(name: str) -> AttentionBackend:
    """The registry entry `name` (`auto` included, which picks per call)."""
    return lookup(BACKENDS, name, OP)


def resolve_attention_backend(name: str, q: torch.Tensor) -> AttentionBackend:
    """The concrete backend `name` stands for with queries `q [T, Hq, D]` (`auto` resolved)."""
    backend = lookup(BACKENDS, name, OP)
    if name == AUTO:
        backend = BACKENDS[choose_attention_backend(q.device, q.dtype, q.shape[-1])]
    backend.check_device(q.device, OP)
    return backend
