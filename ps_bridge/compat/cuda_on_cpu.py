"""Run megatron-core's hard-coded CUDA calls on the CPU when CUDA is absent.

megatron-core calls `torch.cuda.current_device()` while building or running a model (RoPE moves
`inv_freq` to it, Gated DeltaNet initialises on it, the pipeline schedule allocates there) and
seeds a CUDA RNG tracker; the pipeline schedules allocate a token counter with `device="cuda"`.
With no CUDA device these calls raise. `enable()` makes them resolve to
the CPU, and only when `torch.cuda.is_available()` is False: on a machine with CUDA it does nothing,
so GPU behaviour is untouched.
"""

from __future__ import annotations

import torch

_ENABLED = False


def enable() -> bool:
    """Patch the CUDA entry points megatron-core hard-codes; returns True if anything was patched."""
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        return False

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    # RNG: megatron's CUDA RNG tracker forks the CUDA generator; on the CPU fork the CPU one.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)  # type: ignore[assignment]
    # the tracker's fork (taken by the embedding under sequence parallelism) reads it from here
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.mem_get_info = lambda device=None: (0, 0)  # type: ignore[assignment]
    torch.cuda.memory_allocated = lambda device=None: 0  # type: ignore[assignment]
    torch.cuda.max_memory_allocated = lambda device=None: 0  # type: ignore[assignment]
    # Megatron-Bridge moves freshly built models with `.cuda()`; keep them where they are.
    torch.nn.Module.cuda = lambda self, device=None: self  # type: ignore[assignment]
    # With tied embeddings and PP > 1, megatron moves the last stage's copy of the embedding with
    # `weight.data.cuda()` before syncing it from the first stage.
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, memory_format=None: self  # type: ignore[assignment]
    _route_schedule_allocations_to_cpu()
    _ENABLED = True
    return True


class _TorchAllocatingOnCpu:
    """`torch` as seen by megatron's pipeline schedules: `zeros(..., device="cuda")` (their token
    counter) allocates on the CPU; everything else is torch itself."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


def _route_schedule_allocations_to_cpu() -> None:
    # The schedules allocate `torch.zeros([], device="cuda")` directly, not through
    # current_device(), so only their module's view of torch is redirected.
    # imported here: megatron-core is heavy; only a CPU run patches its schedules
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchAllocatingOnCpu()
