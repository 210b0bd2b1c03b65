"""CUDA graphs of the model's forward and backward on packed micro-batches whose layout repeats.

A small model's step on a short pack is host-bound: megatron's modules, fla's Triton launchers and
the attention calls cost more host time per layer than the GPU spends on the layer's kernels
(BENCHMARKS.md, "small shapes"). A CUDA graph replays all of a pass's kernels from one host call.
The graphs hold the model up to its output layer (it returns the final hidden states at the read
positions); the output layer runs eagerly on them (`graphed`), so no graph's memory holds logits.
It replays exactly what was captured: the same kernels, grids and host integers (sequence counts,
maximum lengths, fla's chunk counts) and the same device buffers. So a graph serves a micro-batch
only when every device tensor the forward reads, other than the token ids, holds the same values as
at capture: its layout has the same `structure_key` (a digest of every layout tensor but the tokens
and labels, and of its other fields). Such a micro-batch's tokens are copied into the captured
layout's token buffer, the graph is replayed, and its output is copied out (the next replay writes
the same buffer).

`ModelGraphs` keeps one model's graphs: a structure is run eagerly the first time it is seen, on the
layout its graph will read (`static_copy`), so that run also does what must not happen under capture:
it builds the layout's kernel plans and fla's chunk index, autotunes Triton's kernels at the
structure's shapes, and initialises fla and torch lazily. The structure is captured the second time
(the process's first capture of each pass kind after one more eager run on a side stream, as
`torch.cuda.graphs` asks: `_warm_up`), and replayed from then on. Every device tensor a graph reads
is the graph's (its pool, its layout's derived values), never a cache's that may drop it: fla's
identity cache is off while capturing, and the chunk index fla is handed lives with its plan. The
least recently run graphs beyond `MAX_GRAPHS` are dropped, and structures not captured yet are
counted apart (`MAX_SEEN`), so that packs seen once do not push graphs out. A graph keeps the memory
its pass used at capture (activations, temporaries) for its replays. A model's graphs of one pass kind share one memory pool (`_Pool`), each
capture reusing the blocks the ones before it freed, so a pool holds about its largest pass rather than
the sum of its passes; `GraphMemory` holds the process's pools to a share of the device's memory
(`PrefixSharingConfig.cuda_graph_memory`): a new graph that does not fit, once pools not run for a
while are dropped, is not kept, and its structure runs eagerly from then on. A forward-only pass
(`torch.no_grad`: verl's old and reference log-probs) is one graph. A pass with gradients is two,
captured together: the forward, and the backward of its output (`torch.autograd.grad`, copied into the
pool's parameter-gradient buffers, which all its backward graphs share); the replayed forward is one
autograd node whose backward replays the second graph and hands autograd the parameters' gradients, so
they accumulate and megatron's gradient hooks run as after an eager backward. The output layer and the
loss run outside the graphs (their gradients flow into the replayed node). Until that backward has run,
no graph of the pool replays: the passes of the pool run eagerly (a replay would overwrite the saved
activations). A capture that fails (a host read of a device tensor, an RNG state set inside the pass)
stops captures in the process (the graphs already captured still replay), and says why once. A graph
reads the parameters' storage as it was at capture: when any parameter or buffer of the model moves
(verl's parameter offload), every graph of the model is dropped.

verl's micro-batches differ in their lengths, so their layouts would hardly ever repeat. With
graphs on, the layouts are built bucketed (`buckets_for`, `tree.materialize.bucket_length`): every
segment of a tree level is padded to the level's bucket length, and the output layer runs on the
positions the structure fixes (`tree.materialize.bucketed_read_positions`). Two such layouts of one
tree shape and the same buckets have the same `structure_key` whatever their lengths inside the
buckets; the kernels then read what follows those lengths from device tensors of fixed shape (the
tokens, positions, valid flags and read positions: `BUCKET_INPUTS`; the attention calls' key offsets
and the Gated DeltaNet conv tails: the layout's `varying` values), which a replay refills from the new
layout before it runs the graph. The padding is computed, and counted in the FLOPs.
Under level buckets (`PrefixSharingConfig.cuda_graph_buckets = "level"`, `tree.level_buckets`) the segments keep
their lengths and each level's block is bucketed: every segment offset, and Gated DeltaNet's filler sequences'
offsets and fla's chunk indices, are `varying` values too (what fla derives from the offsets is recorded in the
graph, its identity cache being off), and only the cascade replays them (`torch_ref` reads the per-token segment
ids).

`graph_refusal` is the one check of where graphs run: one CUDA device, no tensor, pipeline or
context parallelism (collectives and stage inputs are not captured), no MoE (its token dispatch
reads expert counts on the host), no images and no vision-language model (the vision tower's inputs
vary with the images; the text-only path has not run under capture), no activation recomputation,
and no dropout in a pass with gradients (megatron sets the CUDA RNG state inside both), and for
Gated DeltaNet layers an fla-core that takes the caller's chunk index (>= 0.6.0); a bucketed
layout also needs an attention backend whose varying inputs are registered (`BUCKET_BACKENDS`).
"""

from __future__ import annotations

import logging
import weakref
from contextlib import nullcontext
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.module import Float16Module, float16_to_fp32
from megatron.core.utils import unwrap_model

from ps_bridge.compat import fla as compat_fla
from ps_bridge.config import PrefixSharingConfig
from ps_bridge.kernels.attention.registry import choose_attention_backend
from ps_bridge.layout import PackedPrefixLayout
from ps_bridge.packed_layout import BUCKET_INPUTS
from ps_bridge.transfer import to_device

logger = logging.getLogger("ps_bridge")

CAPTURE_AT = 2  # a structure is captured the second time it is run: a one-off pack is never captured
# captured graphs kept per model, the least recently run dropped beyond (each holds its output, the final hidden
# states, in its pool, whose bytes `GraphMemory` bounds)
MAX_GRAPHS = 16
# structures a model counts before their capture, the oldest forgotten beyond: a pack seen once never pushes
# a captured graph out
MAX_SEEN = 64
STALE_PASSES = 64  # a graph not run in the process's last this many graphed passes may make room for a new one


# the attention backends whose kernels read a bucketed layout's lengths only through registered
# `varying` values (`auto` picks the cascade on CUDA in bf16/fp16); under level buckets the per-token
# segment and group ids follow the lengths too, which `torch_ref` reads
BUCKET_BACKENDS = ("auto", "flash_atten_gpu", "torch_ref")
LEVEL_BUCKET_BACKENDS = ("auto", "flash_atten_gpu")


def graph_refusal(model: torch.nn.Module, layout: PackedPrefixLayout, backend: Optional[str] = None) -> Optional[str]:
    """Why the forward of `model` on `layout` (attention backend `backend`) is not run as a CUDA
    graph, or None when it can be."""
    if layout.device.type != "cuda":
        return f"the model runs on {layout.device.type}, CUDA graphs need a CUDA device"
    if layout.images is not None:
        return "the micro-batch carries images (the vision tower's inputs differ per micro-batch)"
    if layout.bucketed and backend is not None and backend not in BUCKET_BACKENDS:
        return f"the attention backend {backend!r} on a bucketed layout (graphs replay buckets with {BUCKET_BACKENDS})"
    if layout.level_buckets and backend is not None:
        refusal = level_bucket_refusal(model, backend, layout.device)
        if refusal:
            return refusal
    return model_refusal(model)


def level_bucket_refusal(model: torch.nn.Module, backend: str, device: torch.device) -> Optional[str]:
    """Why `model`'s passes with attention backend `backend` cannot replay level-bucketed layouts, or
    None: the attention `backend` resolves to must read the segment offsets from registered `varying`
    values only (the cascade; `auto` resolved for the model's dtype and head dim)."""
    module = unwrap_model(model)
    config = getattr(module, "config", None)
    resolved = backend
    if backend == "auto":
        param = next(torch.nn.Module.parameters(model), None)
        head_dim = getattr(config, "kv_channels", None)
        resolved = "torch_ref" if param is None or head_dim is None else choose_attention_backend(
            device, param.dtype, int(head_dim))
    if resolved not in LEVEL_BUCKET_BACKENDS:
        return (f"the attention backend {backend!r}" + (f" (here {resolved!r})" if resolved != backend else "")
                + f" on a level-bucketed layout (graphs replay level buckets with {LEVEL_BUCKET_BACKENDS})")
    return None


def _has_gated_deltanet(model: torch.nn.Module) -> bool:
    """Whether the model has Gated DeltaNet layers (Megatron-Bridge's `linear_attention_freq`)."""
    module = unwrap_model(model)
    config = getattr(module, "config", None)
    pattern = getattr(config, "linear_attention_freq", None)
    return bool(pattern) and (not isinstance(pattern, (list, tuple)) or any(pattern))


def model_refusal(model: torch.nn.Module) -> Optional[str]:
    """The part of `graph_refusal` that depends on the model and the parallel layout only."""
    sizes = (
        ("tensor", parallel_state.get_tensor_model_parallel_world_size()),
        ("pipeline", parallel_state.get_pipeline_model_parallel_world_size()),
        ("context", parallel_state.get_context_parallel_world_size()),
    )
    for name, size in sizes:
        if size > 1:
            return f"{name} parallelism ({name} size {size}): its collectives are not captured"
    module = unwrap_model(model)
    if not hasattr(module, "output_logits"):
        return f"{type(module).__name__} does not stop before its output layer (ps_bridge's models do: SelectedOutputsMixin)"
    if hasattr(module, "vision_model"):
        return "a vision-language model (its forward has not been checked under capture on a GPU)"
    config = getattr(module, "config", None)
    if _has_gated_deltanet(model) and not compat_fla.takes_chunk_indices():
        # fla then derives the chunk index on the host and keeps it in its identity cache only, which
        # may free it while a graph still reads it
        return (f"Gated DeltaNet layers with fla-core {compat_fla.fla_version()}: it ignores the caller's chunk "
                f"index (fla-core >= {compat_fla.CHUNK_INDICES_SINCE} takes it)")
    if getattr(config, "num_moe_experts", None):
        return "an MoE model: its token dispatch reads the experts' token counts on the host"
    # megatron sets the CUDA RNG state inside these (its RNG tracker's fork around dropout, the
    # recomputed forward of a checkpointed layer), which a capture does not allow
    if getattr(config, "recompute_granularity", None):
        return f"activation recomputation (recompute_granularity={config.recompute_granularity!r})"
    dropout = {k: getattr(config, k, 0.0) or 0.0 for k in ("hidden_dropout", "attention_dropout")}
    if any(dropout.values()) and torch.is_grad_enabled():
        return "dropout (" + ", ".join(f"{k}={v}" for k, v in dropout.items()) + ")"
    return None


def buckets_for(model: torch.nn.Module, config) -> bool:
    """Whether the layouts of `model`'s micro-batches are built bucketed (`SharingPlan.bucket`): with
    `config.cuda_graphs`, on CUDA, where `model_refusal` allows graphs and the attention backend
    reads buckets (under level buckets: where `level_bucket_refusal` allows), and while captures have
    not stopped in the process: elsewhere the padding would be computed for nothing, and the sharing
    rule, which under graphs shares whatever replays, decides as for eager passes."""
    if not getattr(config, "cuda_graphs", False) or config.backend not in BUCKET_BACKENDS or ModelGraphs.stopped:
        return False
    device = parameter_device(model)
    if device is None or device.type != "cuda" or model_refusal(model) is not None:
        return False
    level = getattr(config, "cuda_graph_buckets", "segment") == "level"
    return not level or level_bucket_refusal(model, config.backend, device) is None


def parameter_device(model: torch.nn.Module) -> Optional[torch.device]:
    """Where `model`'s first parameter lives (None without parameters)."""
    param = next(torch.nn.Module.parameters(model), None)
    return None if param is None else param.device


def static_copy(layout: PackedPrefixLayout) -> PackedPrefixLayout:
    """A graph's own layout: `layout` with buffers of its own for `BUCKET_INPUTS` (later micro-batches'
    are copied into them) and a `host` of its own without the derived values: the device tensors
    derived from it (the attention and GDN plans, the `varying` values) are built by the structure's
    first, eager run on it, read by the graph and refilled by replays, none of them the caller's. They
    live as long as this layout, so as long as the graph."""
    host = {k: v for k, v in layout.host.items() if k not in ("derived", "varying")}
    own = {name: getattr(layout, name) for name in BUCKET_INPUTS}
    return replace(layout, host=host, **{name: t.clone() for name, t in own.items() if t is not None})


def load(static: PackedPrefixLayout, layout: PackedPrefixLayout) -> None:
    """`layout`'s values into `static`, a captured (or to be captured) layout of its structure: a
    bucketed layout's through `refill`, another's tokens (the only tensor in which two layouts of one
    structure differ)."""
    if layout.bucketed:
        refill(static, layout)
    else:
        static.tokens.copy_(layout.tokens)


def refill(static: PackedPrefixLayout, layout: PackedPrefixLayout) -> None:
    """Copies what the forward of bucketed `layout` reads into the captured `static` layout of the same
    structure: `BUCKET_INPUTS`, and every `varying` value registered on `static` (built from `layout`
    on the host and copied without waiting for the GPU)."""
    for name in BUCKET_INPUTS:
        if getattr(static, name) is not None:
            getattr(static, name).copy_(getattr(layout, name))
    for build, tensor in static.host.get("varying", {}).values():
        tensor.copy_(to_device(build(layout), tensor.device))


def storage_fingerprint(model: torch.nn.Module) -> Tuple[int, ...]:
    """Where every parameter and buffer of `model` lives: a graph is valid while this is unchanged.
    (nn.Module's own methods: megatron's DDP sets an attribute `buffers`, its gradient buffers.)"""
    params = torch.nn.Module.parameters(model)
    return tuple(t.data_ptr() for t in params) + tuple(t.data_ptr() for t in torch.nn.Module.buffers(model))


def without_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """The module megatron's DDP wraps (or `model`): what `torch.func.functional_call` runs with
    parameter aliases. Only DDP is unwrapped: its forward is its module's, while megatron's
    Float16Module, inside it, casts the inputs and the last stage's outputs."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


@dataclass
class _Graph:
    """One structure's state: how often it was run, the layout its graphs read (made at its first run,
    which is eager on it; a replay loads its inputs into it), and once captured the forward graph and
    its static output; for a pass with gradients also the backward graph, its static output gradient
    and the parameters' gradients (its pool's gradient buffers)."""

    seen: int = 0
    failed: bool = False
    layout: Optional[PackedPrefixLayout] = None
    graph: Optional[object] = None
    output: Optional[torch.Tensor] = None
    backward: Optional[object] = None
    grad_output: Optional[torch.Tensor] = None
    # weak references: megatron's DDP hooks on the parameters reach the model, which keys `_GRAPHS`
    # weakly; a strong reference here would keep the model, and every graph's memory, alive for good
    params: Tuple["weakref.ref[torch.Tensor]", ...] = ()
    grads: Tuple[Optional[torch.Tensor], ...] = ()


class _Waiting:
    """What a replayed forward's autograd node holds until its backward has run (`_Pool.waiting`)."""


@dataclass
class _Pool:
    """The memory pool that one model's graphs of one pass kind (forward-only, or with gradients) are
    captured into. A graph's pool keeps the memory its pass used at capture (activations, temporaries)
    for its replays; graphs captured into one pool reuse the blocks the ones before them freed at the
    end of their capture, so the pool holds about its largest pass, not the sum of them. That is safe
    because the passes of a pool never overlap: a forward-only replay is over (its output copied out)
    before the next pass starts, and while a replayed forward awaits its backward (`waiting`), no graph
    of the pool replays.

    handle:  torch's id of the pool; None before its first capture, and again once its graphs are
             dropped (torch frees a pool's memory when the last graph captured into it is gone).
    tokens:  the packed tokens of each structure captured into it.
    last_run: the clock (`GraphMemory.clock`) of each such structure's last run.
    nbytes:  its bytes (`GraphMemory.pool_bytes`), measured after each capture.
    grads:   with gradients, the parameters' gradient buffers that every backward graph of the pool
             writes (copied out of the pool by autograd's accumulation before the next pass), so that
             no graph holds a model-sized gradient of its own.
    waiting: a weak reference to the `_Waiting` of the replayed forward whose backward has not run:
             its saved activations are in the pool, where any replay of the pool would overwrite them.
             A pass dropped before its backward frees it with its autograd node."""

    handle: Optional[object] = None
    tokens: Dict[tuple, int] = field(default_factory=dict)
    last_run: Dict[tuple, int] = field(default_factory=dict)
    nbytes: int = 0
    grads: Optional[Tuple[torch.Tensor, ...]] = None
    waiting: Optional["weakref.ref[_Waiting]"] = None

    def awaiting_backward(self) -> bool:
        return self.waiting is not None and self.waiting() is not None

    def reset(self) -> None:
        """Its graphs are gone: the next capture starts a new pool (a replayed pass still awaiting its
        backward keeps the old pool's memory, and its gradient buffers, until then)."""
        self.handle, self.nbytes, self.grads, self.waiting = None, 0, None, None
        self.tokens.clear()
        self.last_run.clear()


_WARMED_UP: set = set()  # pass kinds (with gradients or not) whose first capture in this process warmed up


def _warm_up(run: Callable[[], None], training: bool) -> None:
    """`run` once on a side stream before the process's first capture of its pass kind: torch's rule
    before a capture, for lazily initialised libraries (cuBLAS workspaces, flash's and fla's first
    calls). Later captures skip it, which saves a whole pass each: a structure is captured the second
    time it runs (`CAPTURE_AT`), and its first run was eager on the layout the capture reads
    (`ModelGraphs.run`), so that layout's plans exist, every Triton kernel is compiled and autotuned
    at the structure's shapes, and the libraries' process-wide state exists. A capture that still met a
    lazy initialisation would fail, and the pass run eagerly (`ModelGraphs.stopped`)."""
    if training in _WARMED_UP:
        return
    _WARMED_UP.add(training)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)


def parameter_aliases(named: Tuple[Tuple[str, torch.Tensor], ...]) -> dict:
    """Fresh leaf tensors over the parameters' storage, by name (for `torch.func.functional_call`)."""
    return {name: p.detach().requires_grad_() for name, p in named}


class CudaGraphCapture:
    """Captures with `torch.cuda.graph` into the memory pool `pool` (None: a new one). `forward(run,
    pool) -> (graph, output)`; `training(run, named, pool, grads) -> (forward graph, output, backward
    graph, output gradient, parameter gradients)`: the backward graph is `torch.autograd.grad` of the
    captured forward's output, in the forward graph's pool (the forward's saved activations are what
    it reads), copied into the buffers `grads` (one per parameter of `named`; None where the pass does
    not reach a parameter). The pass with gradients runs the model on aliases of its parameters
    (`run(aliases)`, `torch.func.functional_call`): gradients taken at the parameters themselves would
    go through their gradient-accumulator nodes, which megatron's DDP keeps from its construction on
    the default stream, and autograd's wait on that stream is not allowed inside a capture
    (torch/csrc/autograd/input_buffer.cpp, "AccumulateGrad node's stream does not match")."""

    @staticmethod
    def forward(run: Callable[[], torch.Tensor], pool=None):
        _warm_up(run, training=False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = run()
        return graph, output

    @staticmethod
    def training(run: Callable[[dict], torch.Tensor], named: Tuple[Tuple[str, torch.Tensor], ...], pool,
                 grads: Tuple[torch.Tensor, ...]):
        def step():
            aliases = parameter_aliases(named)
            out = run(aliases)
            torch.autograd.grad(out, tuple(aliases.values()), torch.ones_like(out), allow_unused=True)

        _warm_up(step, training=True)
        aliases = parameter_aliases(named)  # made on this stream, their accumulators under the capture
        forward = torch.cuda.CUDAGraph()
        with torch.cuda.graph(forward, pool=pool):
            output = run(aliases)
        grad_output = torch.empty_like(output)
        backward = torch.cuda.CUDAGraph()
        with torch.cuda.graph(backward, pool=forward.pool()):
            got = torch.autograd.grad(output, tuple(aliases.values()), grad_output, allow_unused=True)
            for into, g in zip(grads, got):
                if g is not None:
                    into.copy_(g)
        return forward, output.detach(), backward, grad_output, tuple(None if g is None else b for b, g in zip(grads, got))


class _Replayed(torch.autograd.Function):
    """A captured forward as one autograd node: its backward replays the backward graph and hands
    the parameters their gradients (autograd accumulates them, and megatron's gradient hooks run).
    Until then the pool's graphs do not replay (`_Pool.waiting`)."""

    @staticmethod
    def forward(ctx, entry: _Graph, pool: _Pool, *params):
        entry.graph.replay()
        ctx.entry, ctx.waiting = entry, _Waiting()
        pool.waiting = weakref.ref(ctx.waiting)
        return entry.output.clone()

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.waiting is None:
            # other passes of the pool may have overwritten the saved activations since the first backward
            raise RuntimeError("a pass replayed from a CUDA graph takes one backward (retain_graph is not supported "
                               "with PS_BRIDGE_CUDA_GRAPHS=1)")
        entry = ctx.entry
        entry.grad_output.copy_(grad_output)
        entry.backward.replay()
        ctx.waiting = None  # the pool's graphs replay again
        return (None, None) + tuple(entry.grads)


def _pool_bytes(pool: _Pool) -> int:
    """The device memory of `pool`: the caching allocator's segments owned by it, and its gradient
    buffers (outside it)."""
    if pool.handle is None or not torch.cuda.is_available():
        return 0
    handle = tuple(pool.handle)
    held = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if tuple(seg["segment_pool_id"]) == handle)
    return held + sum(g.numel() * g.element_size() for g in pool.grads or ())


def _cuda_total() -> int:
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


class GraphMemory:
    """The device memory the process's graphs hold (their pools', `_Pool`), and the share of the device's
    memory they may hold (`fraction`, `PrefixSharingConfig.cuda_graph_memory`). A pool makes room for
    another only once it is stale: none of its graphs run in the process's last `stale_passes` graphed
    passes, and none awaiting its backward (its graphs are then dropped, and its memory freed; their
    structures, should they come back, are captured anew). verl's phases take turns (log-probs with the
    actor, with the reference model, then the actor's update), each in pools of its own, so the pools of
    the phases before the running one are the stale ones: dropping those for the running phase's would
    recapture every phase's graphs each step. A capture that would grow its pool past the share is not
    made where the pools held predict that (their bytes per token of their largest pass, by pass kind:
    a pool holds its largest pass), else it is made, and its graph dropped (its blocks stay in the pool,
    for the pool's later captures). Tests pass `pool_bytes` (a `_Pool` -> its bytes) and `total` (the
    device's bytes)."""

    def __init__(self, pool_bytes: Callable[[_Pool], int] = _pool_bytes, total: Callable[[], int] = _cuda_total,
                 fraction: float = PrefixSharingConfig.cuda_graph_memory, stale_passes: int = STALE_PASSES):
        self.pool_bytes, self.total, self.fraction, self.stale_passes = pool_bytes, total, fraction, stale_passes
        self.clock = 0  # graphed passes run in this process
        self.models: "weakref.WeakSet[ModelGraphs]" = weakref.WeakSet()  # a model's graphs die with it

    def budget(self) -> int:
        return int(self.fraction * self.total())

    def pools(self):
        """(model's graphs, pass kind, pool) of every pool that holds graphs."""
        return [(graphs, training, pool) for graphs in list(self.models)
                for training, pool in graphs.pools.items() if pool.tokens]

    def used(self) -> int:
        return sum(pool.nbytes for _, _, pool in self.pools())

    def add(self, graphs: "ModelGraphs", key: tuple) -> None:
        """`key` was captured into its pool (`graphs.pools[key[1]]`), whose bytes are measured anew."""
        self.models.add(graphs)
        pool = graphs.pools[key[1]]
        pool.last_run[key] = self.clock
        pool.nbytes = self.pool_bytes(pool)

    def touch(self, graphs: "ModelGraphs", key: tuple) -> None:
        """A graphed pass of `key` runs (replayed or not)."""
        self.clock += 1
        pool = graphs.pools[key[1]]
        if key in pool.last_run:
            pool.last_run[key] = self.clock

    def room_for(self, graphs: "ModelGraphs", key: tuple, tokens: int) -> bool:
        """Before `key`'s capture: whether its pool, grown to hold a pass of `tokens`, fits once stale
        pools are dropped (True where no pool of its kind is held to predict from)."""
        rates = [pool.nbytes / max(pool.tokens.values()) for _, training, pool in self.pools() if training == key[1]]
        if not rates:
            return True
        pool = graphs.pools[key[1]]
        return self._fit(max(int(max(rates) * tokens) - pool.nbytes, 0), pool)

    def make_room(self, graphs: "ModelGraphs", key: tuple) -> None:
        """After `key`'s capture: stale pools dropped until the graphs fit the share, else `key`'s graph."""
        if not self._fit(0, graphs.pools[key[1]]):
            graphs.drop_for_memory(key, self, graphs.pools[key[1]].tokens.get(key, 0))

    def _stale(self, pool: _Pool) -> Optional[int]:
        """The clock of `pool`'s last run where it may be dropped (every graph in it stale, none awaiting
        its backward), else None."""
        last = max(pool.last_run.values())
        return last if self.clock - last > self.stale_passes and not pool.awaiting_backward() else None

    def _fit(self, extra: int, keep: _Pool) -> bool:
        while self.used() + extra > self.budget():
            stale = [(last, graphs, training) for graphs, training, pool in self.pools()
                     if pool is not keep and (last := self._stale(pool)) is not None]
            if not stale:
                return False
            _, graphs, training = min(stale, key=lambda s: s[0])  # the least recently run first
            graphs.drop_pool(training)
        return True


MEMORY = GraphMemory()  # the process's


class ModelGraphs:
    """The CUDA graphs of one model, keyed by layout structure and by whether the pass has
    gradients (see the module docstring), in two memory pools (`_Pool`): the forward-only passes' and
    those with gradients. `capture` makes them (`CudaGraphCapture`; tests pass one that reruns the
    forward eagerly)."""

    stopped: Optional[str] = None  # why captures stopped in this process (the first failed one)

    def __init__(self, capture=CudaGraphCapture, max_graphs: int = MAX_GRAPHS, memory: Optional[GraphMemory] = None,
                 max_seen: int = MAX_SEEN):
        self.capture = capture
        self.max_graphs, self.max_seen = max_graphs, max_seen
        self.memory = memory or MEMORY
        self.graphs: "OrderedDict[tuple, _Graph]" = OrderedDict()
        self.pools = {False: _Pool(), True: _Pool()}
        # structures whose graph was dropped for memory: they run eagerly
        self.no_room: set = set()
        self.fingerprint: Optional[Tuple[int, ...]] = None
        self.captures = 0
        self.replays = 0

    def run(self, model: torch.nn.Module, layout: PackedPrefixLayout, key: tuple,
            forward: Callable[[PackedPrefixLayout, Optional[dict]], torch.Tensor]) -> torch.Tensor:
        """`forward(layout, None)`, replayed from a graph where one was captured for `layout`'s
        structure (`key` adds what else the forward depends on: the attention backend).
        `forward(layout, params)` runs the model with `params` (name -> tensor) in place of its own."""
        fingerprint = storage_fingerprint(model)
        if fingerprint != self.fingerprint:
            if self.graphs:
                logger.info("[PS][graphs] the model's parameters moved: its %d CUDA graphs are dropped", len(self.graphs))
            for old in list(self.graphs):
                self._forget(old)
            self.no_room.clear()
            self.fingerprint = fingerprint
        training = torch.is_grad_enabled()
        pool = self.pools[training]
        key = (layout.structure_key(), training) + tuple(key)
        if key in self.no_room:
            return forward(layout, None)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = _Graph()
            self._drop_oldest(captured=False, keep=self.max_seen)
        self.graphs.move_to_end(key)
        self.memory.touch(self, key)
        entry.seen += 1
        ahead = entry.graph is None and not entry.failed and not ModelGraphs.stopped
        if ahead and entry.layout is None:
            # the structure's first run, eager on the layout a capture will read: what the pass derives
            # from it (kernel plans, fla's chunk index, Triton's autotuning at its shapes) is then made
            # before the capture, not inside it
            entry.layout = static_copy(layout)
            return forward(entry.layout, None)
        if ahead and entry.seen >= CAPTURE_AT:
            if self.memory.room_for(self, key, layout.num_tokens):
                self._capture(entry, key, model, layout, forward, training)
            else:
                self.drop_for_memory(key, self.memory, layout.num_tokens)
        if entry.graph is None or pool.awaiting_backward() or key in self.no_room:
            return forward(layout, None)
        load(entry.layout, layout)
        self.replays += 1
        COUNTS["replays"] += 1
        if not training:
            entry.graph.replay()
            return entry.output.clone()
        return _Replayed.apply(entry, pool, *(ref() for ref in entry.params))

    def _forget(self, key: tuple) -> None:
        """`key`'s entry gone: out of its pool (whose memory torch frees with its last graph)."""
        self.graphs.pop(key, None)
        pool = self.pools[key[1]]
        pool.tokens.pop(key, None)
        pool.last_run.pop(key, None)
        if not pool.tokens:
            pool.reset()

    def _drop_oldest(self, captured: bool, keep: int) -> None:
        """The least recently run entries beyond `keep` dropped, of the captured graphs or of the structures
        not captured (a dropped structure that comes back is seen anew)."""
        kind = [k for k, entry in self.graphs.items() if (entry.graph is not None) == captured]
        for k in kind[:max(len(kind) - keep, 0)]:
            self._forget(k)

    def drop_pool(self, training: bool) -> None:
        """Every graph of the pool of pass kind `training` dropped: the pool's memory is freed."""
        for k in list(self.pools[training].tokens):
            self._forget(k)

    def drop_for_memory(self, key: tuple, memory: GraphMemory, tokens: int) -> None:
        """`key`'s graph dropped or never captured, and its structure eager from now on."""
        self._forget(key)
        self.no_room.add(key)
        COUNTS["no_room"] += 1
        # said once at INFO (with the setting to raise); each later structure at DEBUG
        logger.log(logging.DEBUG if COUNTS["no_room"] > 1 else logging.INFO,
                   "[PS][graphs] a %d-token pass runs eagerly from now on: with its CUDA graph the process's graphs "
                   "would hold more than %.1f GiB (cuda_graph_memory=%g of the device's memory; raise "
                   "PS_BRIDGE_CUDA_GRAPH_MEMORY where the device has room)", tokens, memory.budget() / 2**30,
                   memory.fraction)

    def _capture(self, entry: _Graph, key: tuple, model, layout: PackedPrefixLayout, forward, training: bool) -> None:
        own = entry.layout  # made at the structure's first run (`run`), eager on it
        load(own, layout)
        pool = self.pools[training]
        # what fla derives from the varlen offsets (its chunk offsets) is computed inside the graph, into
        # its memory: a value from fla's identity cache would be freed when the cache drops it, while the
        # graph reads it at every replay (and under level buckets a replay refills the offsets)
        caching = compat_fla.identity_cache_off() if _has_gated_deltanet(model) else nullcontext()
        try:
            with caching:
                self._capture_into(entry, model, own, forward, training, pool)
        except RuntimeError as e:
            entry.failed = True
            if not pool.tokens:
                pool.reset()
            # a capture that failed inside torch.cuda.graph can leave CUDA's RNG in its capture state
            # (a later random draw then fails), so none is tried again in this process
            ModelGraphs.stopped = str(e).splitlines()[0] if str(e) else type(e).__name__
            logger.warning("[PS][graphs] CUDA graphs are off for the rest of this process: a capture failed (%s)",
                           ModelGraphs.stopped)
            return
        self.captures += 1
        COUNTS["captures"] += 1
        pool.tokens[key] = layout.num_tokens
        self._drop_oldest(captured=True, keep=self.max_graphs)  # `key`, run last, is the newest
        self.memory.add(self, key)
        self.memory.make_room(self, key)
        if key not in self.no_room:
            logger.info("[PS][graphs] captured the %s of a %d-token micro-batch (depth %d); it replays from now on",
                        "forward and backward" if training else "forward", layout.num_tokens, layout.tree_depth)

    def _capture_into(self, entry: _Graph, model, own: PackedPrefixLayout, forward, training: bool, pool: _Pool) -> None:
        if training:
            named = tuple((n, p) for n, p in without_data_parallel(model).named_parameters() if p.requires_grad)
            if pool.grads is None:
                pool.grads = tuple(torch.zeros_like(p) for _, p in named)
            graph, output, backward, grad_output, grads = self.capture.training(
                lambda aliases: forward(own, aliases), named, pool.handle, pool.grads)
            entry.backward, entry.grad_output, entry.grads = backward, grad_output, grads
            entry.params = tuple(weakref.ref(p) for _, p in named)
        else:
            graph, output = self.capture.forward(lambda: forward(own, None), pool.handle)
        if pool.handle is None:
            pool.handle = graph.pool()
        entry.layout, entry.graph, entry.output = own, graph, output


# captures, replays and structures left eager for the memory share (`GraphMemory`), of every model of this
# process (verl-check reports them per phase)
COUNTS = {"captures": 0, "replays": 0, "no_room": 0}

_GRAPHS: "weakref.WeakKeyDictionary[torch.nn.Module, ModelGraphs]" = weakref.WeakKeyDictionary()
_REFUSED: set = set()


def model_graphs(model: torch.nn.Module) -> ModelGraphs:
    """The graphs of `model` (made on first use, dropped with the model)."""
    graphs = _GRAPHS.get(model)
    if graphs is None:
        graphs = _GRAPHS[model] = ModelGraphs()
    return graphs


def graphed(model: torch.nn.Module, layout: PackedPrefixLayout, backend: Optional[str],
            forward: Callable[..., torch.Tensor], memory_share: float) -> torch.Tensor:
    """`forward(layout, None)` (the logits) with the model up to its output layer through the model's
    graphs, where `graph_refusal` allows for the attention `backend` (a graph is kept per backend), else
    eagerly (the reason logged once per reason). `forward(layout, weights, hidden_states_only=True)` is the
    model stopped before its output layer (`SelectedOutputsMixin`): the graphs capture that, and the output
    layer runs eagerly on the hidden states they return. So a graph's memory pool holds the final hidden
    states, not the logits, which at verl's shapes are the larger part of a pass's memory (16k read
    positions of Qwen3.5's 248k vocabulary are 8 GB in bf16, their gradient as much again); the output
    layer is one GEMM each way, so little host time is left outside. A model in megatron's Float16Module
    runs that part without the module's cast (`fp32_output=False`: the hidden states stay in half
    precision), and the cast follows the output layer, as in the module. `memory_share`: the share of the
    device's memory the process's graphs may hold (`GraphMemory`)."""
    refusal = graph_refusal(model, layout, backend)
    if refusal is not None:
        if refusal not in _REFUSED:
            _REFUSED.add(refusal)
            logger.info("[PS][graphs] the forward runs without CUDA graphs: %s", refusal)
        return forward(layout, None)
    graphs = model_graphs(model)
    graphs.memory.fraction = memory_share
    return run_graphed(graphs, model, layout, backend, forward)


def run_graphed(graphs: ModelGraphs, model: torch.nn.Module, layout: PackedPrefixLayout, backend: Optional[str],
                forward: Callable[..., torch.Tensor]) -> torch.Tensor:
    """`graphed`'s pass through `graphs`: the model up to its final hidden states at the layout's output
    positions from a graph, then the output layer eagerly on those the rows read (`output_keep`, which
    follows the lengths inside the buckets, so no graph holds it)."""
    half = isinstance(without_data_parallel(model), Float16Module)
    cast = {"fp32_output": False} if half else {}
    hidden = graphs.run(model, layout, (backend,),
                        lambda own, weights: forward(own, weights, hidden_states_only=True, **cast))
    logits = unwrap_model(model).output_logits(hidden, keep=layout.output_keep)
    return float16_to_fp32(logits) if half else logits
