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


# the device types where `CompiledOp`s run compiled; elsewhere (the CPU, Ascend NPUs) the ops run their
# plain expressions
COMPILED_DEVICES: Tuple[str, ...] = ("cuda",)


def runs_compiled(t: torch.Tensor) -> bool:
    """Whether an element-wise op on `t` runs its `CompiledOp`."""
    return t.device.type in COMPILED_DEVICES


class CompiledOp:
    """An element-wise op as two functions torch.compile compiles on first use (dynamic shapes: the
    token count changes with every micro-batch): `forward(*tensors, *constants)` and
    `backward(*output_grads, *tensors, *constants)` -> the gradients of `tensors`. The forward saves
    its input tensors only; the backward recomputes what it needs from them (one pass over the inputs
    instead of keeping intermediates). `op(*tensors, *constants)` runs it under autograd, on contiguous
    copies of the tensors unless `contiguous=False` (the compiled kernels read any strides). Tensors of
    rank above 2 are passed as rows of their last dimension, and the outputs given the first tensor's
    leading dimensions back: the compiled functions see one rank whatever the caller's (hidden states
    `[T, 1, H]`, per-head q/k `[T, 1, heads, D]`), so torch.compile does not compile a variant per rank."""

    def __init__(self, forward, backward, num_tensors: int, contiguous: bool = True):
        self.num_tensors, self.contiguous = num_tensors, contiguous
        self._functions = (forward, backward)

    @functools.cached_property
    def compiled(self):
        with compile_allowed():
            return tuple(torch.compile(f, dynamic=True) for f in self._functions)

    def __call__(self, *args):
        n = self.num_tensors
        tensors = tuple(t.contiguous() for t in args[:n]) if self.contiguous else args[:n]
        lead = tensors[0].shape[:-1]
        if all(t.dim() <= 2 for t in tensors):
            return _CompiledOpFunction.apply(self, *tensors, *args[n:])
        rows = tuple(t.reshape(-1, t.shape[-1]) if t.dim() > 2 else t for t in tensors)
        out = _CompiledOpFunction.apply(self, *rows, *args[n:])
        if isinstance(out, tuple):
            return tuple(o.view(*lead, o.shape[-1]) for o in out)
        return out.view(*lead, out.shape[-1])


class _CompiledOpFunction(torch.autograd.Function):
    # The compiled functions get detached tensors: dynamo guards on each input's `requires_grad`, so
    # passes with and without gradients would compile separate variants, and past torch's recompile
    # limit a variant runs uncompiled (other roundings than the compiled one: a CUDA graph's replay
    # would then differ from the eager pass).
    @staticmethod
    def forward(ctx, op, *args):
        tensors, ctx.op, ctx.constants = args[: op.num_tensors], op, args[op.num_tensors:]
        ctx.save_for_backward(*tensors)
        return op.compiled[0](*(t.detach() for t in tensors), *ctx.constants)

    @staticmethod
    def backward(ctx, *grads):
        grads = tuple(g.detach().contiguous() for g in grads)
        out = ctx.op.compiled[1](*grads, *(t.detach() for t in ctx.saved_tensors), *ctx.constants)
        return (None, *out, *(None,) * len(ctx.constants))


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
