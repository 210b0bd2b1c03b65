"""The prefix-shared attention backends by name, and the `auto` choice.

Each backend is called as `backend(q, k, v, layout, softmax_scale)`. `auto` is an entry like the
others; it picks a backend per call with `choose_attention_backend` (see `resolve_attention_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

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
    # the deepest prefix tree it runs (None: any); a deeper one is refused with a clear message
    max_tree_depth: Optional[int] = None

    def __call__(self, q, k, v, layout: PackedPrefixLayout, softmax_scale: float) -> torch.Tensor:
        self.check_tree_depth(layout.tree_depth)
        return self.attention(q, k, v, layout, softmax_scale)

    def check_tree_depth(self, depth: int) -> None:
        if self.max_tree_depth is not None and depth > self.max_tree_depth:
            raise ValueError(
                f"the {OP} backend {self.name!r} runs prefix trees of depth <= {self.max_tree_depth} "
                f"(prompts and their responses); this micro-batch's tree has depth {depth}: share one level "
                "with --no-tree (under verl PS_BRIDGE_TREE=0; a layout: share=True), or limit the tree's "
                "depth to 1 (--tree-max-depth 1, PS_BRIDGE_TREE_MAX_DEPTH=1), or use backend "
                "'flash_atten_gpu' (the cascade, any depth), 'flex' or 'torch_ref' (or 'auto')"
            )


def choose_attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int, tree_depth: int = 1) -> str:
    """`auto`'s choice, for a prefix tree of any depth: the cascade where the CUDA flash kernels take
    the inputs (fp16/bf16, a head dim that is a multiple of 8 up to 256), else the reference (CPU,
    float32 exactness runs). The cascade copies no key/value and was fastest or within a few percent
    of the fastest in the measurements (docs/how-it-works.md section 4, BENCHMARKS.md); on trees its
    launches grow with the depth only (cascade.py). `tree_depth` does not change the choice (every
    candidate runs any depth); it is kept for callers that pass it."""
    return "flash_atten_gpu" if flash_takes(device, dtype, head_dim) else "torch_ref"


def _auto(q, k, v, layout: PackedPrefixLayout, softmax_scale: float) -> torch.Tensor:
    return resolve_attention_backend(AUTO, q, layout.tree_depth)(q, k, v, layout, softmax_scale)


BACKENDS: Dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend(
            "torch_ref", "dense masked softmax per group in plain PyTorch; exact, the reference",
            None, None, prefix_shared_attention_torch_ref,
        ),
        AttentionBackend(
            "flash_atten_gpu",
            "cascade of varlen flash calls, launches growing with the tree's depth, no key/value copies "
            "(CPU: torch's CPU op, for tests)",
            ("cuda", "cpu"), FLASH_DTYPES, prefix_shared_attention_cascade,
        ),
        AttentionBackend(
            "flash_atten_gpu_expand", "one varlen flash call over gathered [prompt; response] keys/values",
            ("cuda", "cpu"), FLASH_DTYPES, prefix_shared_attention_expand, 1,
        ),
        AttentionBackend(
            "flex", "FlexAttention with a prefix-sharing block mask (compiled on CUDA, eager elsewhere)",
            None, None, prefix_shared_attention_flex,
        ),
        AttentionBackend(
            "flash_atten_npu", "the expand design on torch_npu's npu_fusion_attention; UNVERIFIED (no NPU here)",
            ("npu",), None, prefix_shared_attention_npu, 1,
        ),
        AttentionBackend(AUTO, "flash_atten_gpu where the flash kernels take the inputs, else torch_ref", None, None, _auto),
    )
}


def get_attention_backend(name: str) -> AttentionBackend:
    """The registry entry `name` (`auto` included, which picks per call)."""
    return lookup(BACKENDS, name, OP)


def resolve_attention_backend(name: str, q: torch.Tensor, tree_depth: int = 1) -> AttentionBackend:
    """The concrete backend `name` stands for with queries `q [T, Hq, D]` on a prefix tree of depth
    `tree_depth` (`auto` resolved)."""
    backend = lookup(BACKENDS, name, OP)
    if name == AUTO:
        backend = BACKENDS[choose_attention_backend(q.device, q.dtype, q.shape[-1], tree_depth)]
    backend.check_device(q.device, OP)
    return backend
