"""Run megatron-core's hard-coded CUDA calls on the CPU when CUDA is absent.

megatron-core calls `torch.cuda.current_device()` while building or running a model (RoPE moves
`inv_freq` to it, Gated DeltaNet initialises on it, the pipeline schedule allocates there) and
seeds a CUDA RNG tracker. With no CUDA device these calls raise. `enable()` makes them resolve to
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
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.mem_get_info = lambda device=None: (0, 0)  # type: ignore[assignment]
    torch.cuda.memory_allocated = lambda device=None: 0  # type: ignore[assignment]
    torch.cuda.max_memory_allocated = lambda device=None: 0  # type: ignore[assignment]
    # Megatron-Bridge moves freshly built models with `.cuda()`; keep them where they are.
    torch.nn.Module.cuda = lambda self, device=None: self  # type: ignore[assignment]
    _ENABLED = True
    return True
