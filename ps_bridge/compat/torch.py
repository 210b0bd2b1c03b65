"""What differs between the torch releases ps-bridge runs on (2.9.1 - 2.14.1).

- The grouped matrix multiply of the grouped MoE experts (`models/experts.py`): public as
  `torch.nn.functional.grouped_mm` in 2.14.1; 2.9.1 has only the private `torch._grouped_mm` (same
  arguments: `(mat_a, mat_b, offs=...)`). Releases in between were not read (`grouped_mm`).
- cuDNN's fused attention, `aten._scaled_dot_product_cudnn_attention` and its `_backward` (the dense
  form `kernels/attention/cudnn.py` calls): in both 2.11.0 (the GPU stack, run) and 2.14.1 (read), same
  schema; a torch without them gets flash only (`has_cudnn_attention`).
- Whether the CPU has AMX tiles: the private `torch.cpu._is_amx_tile_supported` (2.9.1 - 2.14.1, which vLLM's
  CPU build also asks); a torch without it is answered False (`cpu_has_amx_tiles`).
"""

from __future__ import annotations

import torch


def grouped_mm():
    """torch's grouped matrix multiply: `torch.nn.functional.grouped_mm` where this torch has it
    (2.14.1), else `torch._grouped_mm` (2.9.1 has only this one). Neither (torch < 2.9): refused."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise RuntimeError("torch.nn.functional.grouped_mm is missing: torch >= 2.9 is needed for grouped experts")
    return fn


def has_cudnn_attention() -> bool:
    """Whether this torch has cuDNN's fused attention ops, forward and backward."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention") and hasattr(
        torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward")


def cpu_has_amx_tiles() -> bool:
    """Whether this machine's CPU has AMX tiles, as torch (and vLLM's CPU build, which asks the same
    function) sees it; False where this torch cannot tell."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())
