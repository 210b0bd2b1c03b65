"""Which varlen kernel (`varlen.VarlenKernel`) runs the flash designs' calls on a device: `kernel_for`."""

from __future__ import annotations

import importlib.util
from typing import Dict

import torch

from ps_bridge.kernels.attention.cudnn import DenseSplitKernel, cudnn_dense_available
from ps_bridge.kernels.attention.varlen import CpuFlashKernel, FlashAttnKernel, TorchFlashKernel, VarlenKernel

_KERNELS: Dict[str, VarlenKernel] = {}


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def kernel_for(device: torch.device, dense: bool = True) -> VarlenKernel:
    """flash-attn on CUDA when installed, else torch's CUDA flash kernels; the CPU op on a CPU. With
    `dense`, where cuDNN's attention is used (`cudnn.cudnn_dense_available`), the kernel that runs a
    call's long elements on it and the rest on flash (`cudnn.DenseSplitKernel`)."""
    device = torch.device(device)
    if device.type == "cuda":
        key = "flash_attn" if flash_attn_installed() else "torch"
    elif device.type == "cpu":
        key = "cpu"
    else:
        raise ValueError(
            f"the varlen flash backends run on CUDA (and on the CPU for tests), not on {device.type!r}; "
            "use the torch_ref backend there"
        )
    if key not in _KERNELS:
        _KERNELS[key] = {"flash_attn": FlashAttnKernel, "torch": TorchFlashKernel, "cpu": CpuFlashKernel}[key]()
    if dense and device.type == "cuda" and cudnn_dense_available(device)[0]:
        split = "cudnn+" + key
        if split not in _KERNELS:
            _KERNELS[split] = DenseSplitKernel(_KERNELS[key])
        return _KERNELS[split]
    return _KERNELS[key]
