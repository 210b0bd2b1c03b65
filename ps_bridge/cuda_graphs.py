"""CUDA graphs of the model's forward on packed micro-batches whose layout repeats.

A small model's forward on a short pack is host-bound: megatron's modules, fla's Triton launchers
and the attention calls cost more host time per layer than the GPU spends on the layer's kernels
(BENCHMARKS.md, "small shapes"). A CUDA graph replays the whole forward's kernels from one host
call. It replays exactly what was captured: the same kernels, grids and host integers (sequence
counts, maximum lengths, fla's chunk counts) and the same device buffers. So a graph serves a
micro-batch only when every device tensor the forward reads, other than the token ids, holds the
same values as at capture: its layout has the same `structure_key` (a digest of every layout tensor
but the tokens and labels, and of its other fields). Such a micro-batch's tokens are copied into
the captured layout's token buffer, the graph is replayed, and its output is copied out (the next
replay writes the same buffer).

`ForwardGraphs` keeps one model's graphs: a structure is run eagerly the first time it is seen
(that run also does what must not happen under capture: Triton's autotuning, fla's and torch's lazy
initialisations), captured the second time (after one more eager run on a side stream, as
`torch.cuda.graphs` requires), and replayed from then on; the least recently used graphs beyond
`MAX_GRAPHS` are dropped. Graphs serve forward-only passes (`torch.no_grad`: verl's old and
reference log-probs); a pass with gradients runs eagerly. A capture that fails (a host read of a
device tensor inside the forward) leaves that structure eager, and says why once. A graph reads the
parameters' storage as it was at capture: when any parameter or buffer of the model moves (verl's
parameter offload), every graph of the model is dropped.

`graph_refusal` is the one check of where graphs run: one CUDA device, no tensor, pipeline or
context parallelism (collectives and stage inputs are not captured), no MoE (its token dispatch
reads expert counts on the host), no images (the vision tower's inputs vary with the images).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Optional, Tuple

import torch
from megatron.core import parallel_state

from ps_bridge.layout import PackedPrefixLayout

logger = logging.getLogger("ps_bridge")

CAPTURE_AT = 2  # a structure is captured the second time it is run: a one-off pack is never captured
MAX_GRAPHS = 4  # graphs kept per model (each holds its own memory pool: the forward's peak activations, its output)


def graph_refusal(model: torch.nn.Module, layout: PackedPrefixLayout) -> Optional[str]:
    """Why the forward of `model` on `layout` is not run as a CUDA graph, or None when it can be."""
    if layout.device.type != "cuda":
        return f"the model runs on {layout.device.type}, CUDA graphs need a CUDA device"
    if layout.images is not None:
        return "the micro-batch carries images (the vision tower's inputs differ per micro-batch)"
    sizes = (
        ("tensor", parallel_state.get_tensor_model_parallel_world_size()),
        ("pipeline", parallel_state.get_pipeline_model_parallel_world_size()),
        ("context", parallel_state.get_context_parallel_world_size()),
    )
    for name, size in sizes:
        if size > 1:
            return f"{name} parallelism ({name} size {size}): its collectives are not captured"
    config = getattr(_unwrap(model), "config", None)
    if getattr(config, "num_moe_experts", None):
        return "an MoE model: its token dispatch reads the experts' token counts on the host"
    return None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def storage_fingerprint(model: torch.nn.Module) -> Tuple[int, ...]:
    """Where every parameter and buffer of `model` lives: a graph is valid while this is unchanged."""
    return tuple(t.data_ptr() for t in model.parameters()) + tuple(t.data_ptr() for t in model.buffers())


@dataclass
class _Graph:
    """One structure's state: how often it was run, and once captured its graph, the layout the
    graph reads (its tokens are the static input) and the static output."""

    seen: int = 0
    graph: Optional[object] = None
    layout: Optional[PackedPrefixLayout] = None
    output: Optional[torch.Tensor] = None
    failed: bool = False


def capture_cuda_graph(run: Callable[[], torch.Tensor]) -> Tuple[object, torch.Tensor]:
    """(graph, static output) of `run` captured with `torch.cuda.graph`, after one eager run on a
    side stream (torch's rule for lazily initialised libraries: cuBLAS workspaces, Triton's
    autotuning, flash's and fla's first calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()
    return graph, output


class ForwardGraphs:
    """The CUDA graphs of one model's forward, keyed by layout structure (see the module docstring).
    `capture(run) -> (graph, output)` makes a graph whose `replay()` reruns `run` into `output`
    (`capture_cuda_graph`; tests pass one that runs eagerly)."""

    def __init__(self, capture: Callable = capture_cuda_graph, max_graphs: int = MAX_GRAPHS):
        self.capture = capture
        self.max_graphs = max_graphs
        self.graphs: "OrderedDict[tuple, _Graph]" = OrderedDict()
        self.fingerprint: Optional[Tuple[int, ...]] = None
        self.captures = 0
        self.replays = 0

    def run(self, model: torch.nn.Module, layout: PackedPrefixLayout, key: tuple,
            forward: Callable[[PackedPrefixLayout], torch.Tensor]) -> torch.Tensor:
        """`forward(layout)`, replayed from a graph where one was captured for `layout`'s structure
        (`key` adds what else the forward depends on: the attention backend)."""
        fingerprint = storage_fingerprint(model)
        if fingerprint != self.fingerprint:
            if self.graphs:
                logger.info("[PS][graphs] the model's parameters moved: its %d CUDA graphs are dropped", len(self.graphs))
            self.graphs.clear()
            self.fingerprint = fingerprint
        key = (layout.structure_key(),) + tuple(key)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = _Graph()
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        entry.seen += 1
        if entry.graph is None and not entry.failed and entry.seen >= CAPTURE_AT:
            self._capture(entry, layout, forward)
        if entry.graph is None:
            return forward(layout)
        entry.layout.tokens.copy_(layout.tokens)
        entry.graph.replay()
        self.replays += 1
        return entry.output.clone()

    def _capture(self, entry: _Graph, layout: PackedPrefixLayout, forward) -> None:
        # the graph's own layout: the caller's, with a token buffer of its own (later micro-batches'
        # tokens are copied into it) and the same `host`, so the device tensors derived from it (the
        # attention and GDN plans) are the ones the eager runs built and the graph reads
        own = replace(layout, tokens=layout.tokens.clone())
        try:
            entry.graph, entry.output = self.capture(lambda: forward(own))
        except RuntimeError as e:
            entry.failed = True
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            logger.warning("[PS][graphs] this micro-batch shape runs without a CUDA graph: capture failed (%s)", first)
            return
        entry.layout = own
        self.captures += 1


_GRAPHS: "weakref.WeakKeyDictionary[torch.nn.Module, ForwardGraphs]" = weakref.WeakKeyDictionary()
_REFUSED: set = set()


def forward_graphs(model: torch.nn.Module) -> ForwardGraphs:
    """The graphs of `model` (made on first use, dropped with the model)."""
    graphs = _GRAPHS.get(model)
    if graphs is None:
        graphs = _GRAPHS[model] = ForwardGraphs()
    return graphs


def graphed(model: torch.nn.Module, layout: PackedPrefixLayout, key: tuple,
            forward: Callable[[PackedPrefixLayout], torch.Tensor]) -> torch.Tensor:
    """`forward(layout)` through the model's graphs where `graph_refusal` allows, else eagerly (the
    reason logged once per reason)."""
    refusal = graph_refusal(model, layout)
    if refusal is not None:
        if refusal not in _REFUSED:
            _REFUSED.add(refusal)
            logger.info("[PS][graphs] the forward runs without CUDA graphs: %s", refusal)
        return forward(layout)
    return forward_graphs(model).run(model, layout, key, forward)
