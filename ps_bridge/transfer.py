"""Host-to-device copies that do not make the host wait for the GPU.

A plain `tensor.to("cuda")` of a CPU tensor synchronizes the stream (torch copies from pageable memory
and waits): the host then waits for every kernel already queued, and the GPU idles while the host
prepares what comes next. The layout, the rows' labels and the kernels' offsets are copied per
micro-batch, so they go through `to_device`: staged in pinned memory and copied asynchronously on
CUDA (the stream orders the copy before the kernels that read it), a plain copy elsewhere.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`, without waiting for the GPU's queued work where the copy goes from the CPU
    to a CUDA device."""
    device = torch.device(device)
    if tensor.device == device or (device.index is None and tensor.device.type == device.type):
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
