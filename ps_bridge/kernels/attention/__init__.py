"""Prefix-shared causal softmax attention over a packed layout, by named backend.

Every backend computes, for packed `q [T, Hq, D]`, `k, v [T, Hkv, D]` (Hq a multiple of Hkv):
a prompt token attends causally inside its prompt; a response token attends to all valid tokens of
its group's prompt and causally inside its own response; padding is never attended to (padding
queries produce finite values that nobody reads). Output `[T, Hq, D]`.

`torch_ref` is the plain, exact reference (any device); faster backends are tested against it:
- `flash_atten_gpu`: the cascade on varlen flash kernels (no key/value copies), see flash.py;
- `flash_atten_gpu_expand`: one bottom-right causal flash call over gathered `[prompt; response]`
  keys/values, see flash.py;
- `flex`: FlexAttention with a prefix-sharing block mask, see flex.py;
- `flash_atten_npu`: the expand design on Ascend's `npu_fusion_attention` (UNVERIFIED: no NPU
  here; tested only against a stand-in that follows the op's documented semantics), see npu.py;
- `auto`: `flash_atten_gpu` on CUDA in fp16/bf16, `torch_ref` elsewhere (CPU, float32).
"""

from __future__ import annotations

from typing import Callable, Dict

from ps_bridge.kernels.attention.flash import prefix_shared_attention_cascade, prefix_shared_attention_expand
from ps_bridge.kernels.attention.flex import prefix_shared_attention_auto, prefix_shared_attention_flex
from ps_bridge.kernels.attention.npu import prefix_shared_attention_npu
from ps_bridge.kernels.attention.torch_ref import prefix_shared_attention_torch_ref

BACKENDS: Dict[str, Callable] = {
    "torch_ref": prefix_shared_attention_torch_ref,
    "flash_atten_gpu": prefix_shared_attention_cascade,
    "flash_atten_gpu_expand": prefix_shared_attention_expand,
    "flex": prefix_shared_attention_flex,
    "flash_atten_npu": prefix_shared_attention_npu,
    "auto": prefix_shared_attention_auto,
}


def get_attention_backend(name: str) -> Callable:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown prefix-sharing attention backend {name!r}; valid backends: {', '.join(sorted(BACKENDS))}"
        ) from None
