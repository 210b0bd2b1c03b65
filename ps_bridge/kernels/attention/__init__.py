"""Prefix-shared causal softmax attention over a packed layout, by named backend.

Every backend computes, for packed `q [T, Hq, D]`, `k, v [T, Hkv, D]` (Hq a multiple of Hkv): a
token attends to every valid token of its node's ancestors in the prefix tree and causally inside
its own node (one level: a prompt token causally inside its prompt, a response token to its whole
prompt and causally inside its own response); padding is never attended to (padding queries
produce finite values that nobody reads). Output `[T, Hq, D]`.

`torch_ref` is the plain, exact reference (any device); faster backends are tested against it.
One module per design:
- `torch_ref.py`: `torch_ref`;
- `cascade.py`: `flash_atten_gpu`, the cascade on varlen flash kernels (prefix trees of any depth,
  launches growing with the depth, no key/value copies);
- `expand.py`: `flash_atten_gpu_expand`, one bottom-right causal flash call over gathered
  `[prompt; response]` keys/values (one level of sharing);
- `flex.py`: `flex`, FlexAttention with a prefix-sharing block mask;
- `npu.py`: `flash_atten_npu`, the expand design on Ascend's `npu_fusion_attention` (UNVERIFIED: no
  NPU here; tested only against a stand-in that follows the op's documented semantics);
- `varlen.py`: the varlen flash kernels (flash-attn, torch CUDA, torch CPU) the flash designs run on;
- `cudnn.py`: cuDNN's dense attention for a call's long elements on Hopper, flash for the rest;
- `kernel_choice.py`: which of those kernels runs on a device (`kernel_for`);
- `registry.py`: `BACKENDS` by name, and `auto` (`flash_atten_gpu` on CUDA in fp16/bf16 with a
  head dim the flash kernels take, `torch_ref` elsewhere).
"""

from ps_bridge.kernels.attention.registry import (
    BACKENDS,
    AttentionBackend,
    choose_attention_backend,
    get_attention_backend,
    resolve_attention_backend,
)

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "choose_attention_backend",
    "get_attention_backend",
    "resolve_attention_backend",
]
