"""What every kernel registry shares: a backend's description and the lookup of one by name.

Each op (`attention`, `gdn`) has a `registry.py` with a dict of frozen backend records by name
(a subclass of `Backend` that adds the op's callables), an `auto` entry, and one `resolve_*`
function that turns a name (`auto` included) into the concrete backend for the inputs at hand.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple, TypeVar

import torch

AUTO = "auto"


@contextlib.contextmanager
def compile_allowed():
    """Fused kernels built with `torch.compile` (FlexAttention, the weighted SwiGLU) are only fused
    when compiled. `TORCHDYNAMO_DISABLE=1` (set by the CLI and the test suite to avoid compiling
    elsewhere) makes `torch.compile` return the function uncompiled. The variable is read when
    `torch.compile` wraps a function, so it is lifted only around those wrappings."""
    saved = os.environ.pop("TORCHDYNAMO_DISABLE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHDYNAMO_DISABLE"] = saved


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 at least (float64 stays float64): the dtype the fused element-wise kernels compute in."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@functools.lru_cache(maxsize=1)
def import_triton():
    """(triton, triton.language), or None where Triton is not installed. Imported on first use, by
    the modules whose fused kernels are written in it: Triton is heavy, and only GPU paths need it."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def triton_kernels(build):
    """`build(triton, tl)` -> a module's Triton kernels, as a function that builds them on its first
    call and returns them after (None where Triton is not installed)."""

    @functools.lru_cache(maxsize=1)
    def kernels():
        modules = import_triton()
        return None if modules is None else build(*modules)

    return kernels


@dataclass(frozen=True)
class Backend:
    """name: registry key; description: one line; devices: device types it runs on (None: any),
    checked by the registry's `resolve_*`; dtypes: input dtypes of its fast path (None: any),
    checked by the kernels themselves (some also run other dtypes on the CPU, for tests)."""

    name: str
    description: str
    devices: Optional[Tuple[str, ...]]
    dtypes: Optional[Tuple[torch.dtype, ...]]

    def check_device(self, device: torch.device, op: str) -> None:
        if self.devices is not None and device.type not in self.devices:
            needs = " or ".join(d.upper() for d in self.devices)
            article = "an" if needs[0] in "AEFHILMNORSX" else "a"  # "an NPU", "a CUDA"
            raise ValueError(f"the {self.name} {op} backend needs {article} {needs} device (got {device}); use torch_ref")


B = TypeVar("B", bound=Backend)


def lookup(backends: Mapping[str, B], name: str, op: str) -> B:
    """`backends[name]`, or the error every registry gives for an unknown name."""
    try:
        return backends[name]
    except KeyError:
        raise ValueError(f"unknown {op} backend {name!r}; valid backends: {', '.join(sorted(backends))}") from None
