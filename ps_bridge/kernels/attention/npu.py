"""`flash_atten_npu`: prefix-shared attention on Ascend NPUs (the expand design). UNVERIFIED.

No NPU was available to this project: this backend is tested only against a plain-PyTorch stand-in
for `torch_npu.npu_fusion_attention` that follows the documented semantics (tests/test_attention_npu.py),
which checks our index plumbing, not the NPU kernel.

Design: the same key/value gather as `flash_atten_gpu_expand` (every response segment's keys are
`[valid prompt tokens; its own tokens]`), then one `npu_fusion_attention` call in `TND` layout with
per-segment query/key lengths. `sparse_mode=3` is the bottom-right-aligned causal mask (query j of a
segment sees keys up to `Lk - Lq + j`), which is exactly prefix-shared attention for a response
segment and plain causal attention for a prompt segment. torch_npu's op has its own autograd; the
gather's backward sums the gathered rows' gradients back onto the pack.
"""

from __future__ import annotations

import torch

from ps_bridge.kernels.attention.expand import expand_plan
from ps_bridge.kernels.attention.varlen import check_shapes
from ps_bridge.layout import PackedPrefixLayout

# sparse_mode=3 takes a fixed 2048 x 2048 upper-triangular mask whatever the sequence lengths
_MASK_SIZE = 2048
_masks: dict = {}


def _causal_mask(device) -> torch.Tensor:
    device = torch.device(device)
    if device not in _masks:
        _masks[device] = torch.triu(torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)
    return _masks[device]


def _fusion_attention():
    try:
        # imported here: torch_npu exists on Ascend machines only
        import torch_npu  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "backend 'flash_atten_npu' needs torch_npu (Ascend NPU); on NVIDIA GPUs use 'flash_atten_gpu', "
            "elsewhere 'torch_ref'"
        ) from None
    return torch_npu.npu_fusion_attention


def prefix_shared_attention_npu(q, k, v, layout: PackedPrefixLayout, softmax_scale: float) -> torch.Tensor:
    check_shapes(q, k, v, layout)
    fusion_attention = _fusion_attention()
    plan = expand_plan(layout)
    rows = plan.key_rows(q.device)
    k_rows, v_rows = k.index_select(0, rows), v.index_select(0, rows)
    out = fusion_attention(
        q,
        k_rows,
        v_rows,
        q.shape[1],  # head_num (query heads; fewer key/value heads is GQA)
        "TND",
        scale=float(softmax_scale),  # the op's default is 1.0, not 1/sqrt(d)
        sparse_mode=3,
        atten_mask=_causal_mask(q.device),
        actual_seq_qlen=plan.call.cu_q[1:],  # cumulative ends, no leading 0
        actual_seq_kvlen=plan.call.cu_k[1:],
    )[0]
    return out
