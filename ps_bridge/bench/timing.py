"""How a packing of a micro-batch is timed: CUDA events (wall clock on a CPU) after warm-up, median
of repeats, torch's peak allocated memory of one step; the actor step and the log-prob pass; and
the unshared baseline split into micro-batches (gradient accumulation) when it does not fit at once.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ps_bridge.bench.catalog import response_row_mask


@dataclass
class ModeResult:
    tokens: int
    actor_ms: float
    logprob_ms: float
    actor_peak_mib: Optional[float]
    logprob_peak_mib: Optional[float]
    micro_batches: int = 1  # >1: the batch did not fit at once and ran split (gradient accumulation)


class _Timer:
    """CUDA events on a GPU, wall clock on a CPU; milliseconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def _peak_mib(device: torch.device, fn) -> Optional[float]:
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def run_actor_step(loaded, layouts, masks, count: float, chunk: int) -> None:
    """What the bench times as the actor step: for each micro-batch, forward, per-sample log-probs
    and the backward of a masked mean log-prob loss over the `count` response tokens of all of them.
    Under context parallelism each rank runs its shard and the step ends with the gradients'
    reduction over the CP group (a trainer's DDP does it once per step), as megatron scales it.
    Under expert parallelism each data-parallel rank runs its own groups and the step ends with the
    data-parallel reduction (expert weights over the expert data-parallel group), averaged as
    megatron's DDP averages the ranks' per-rank mean losses (`finish_gradients`)."""
    from ps_bridge.parallel import finish_gradients
    from ps_bridge.runtime import row_logprobs

    for layout, mask in zip(layouts, masks):
        rows = row_logprobs(loaded, layout, chunk_rows=chunk)  # gradient to this CP rank's own rows
        (-(rows * mask).sum() / count * loaded.cp).backward()
    if loaded.cp > 1 or loaded.ep > 1:
        finish_gradients(loaded.model, loaded.provider, data_parallel_mean=True)


def run_mode(
    loaded, layouts, backend: str, warmup: int, repeats: int, chunk: int, progress, max_tokens: Optional[int] = None
) -> Tuple[ModeResult, torch.Tensor]:
    """Time one packing of the micro-batch; returns its timings and its response log-probs.

    `layouts` is one layout, or several that split the samples in order: then one actor step runs
    them as consecutive micro-batches with gradient accumulation (how a trainer runs a batch that does
    not fit at once), and the log-prob pass runs each of them.

    `max_tokens`: a micro-batch with more packed tokens per GPU (its CP shard) is not run but
    reported as out of memory. Every rank decides alike from the layout, so no rank enters a
    collective its peer never reaches (under NCCL a rank that runs out of memory in the middle of a
    collective hangs its peers)."""
    for layout in [layouts] if not isinstance(layouts, (list, tuple)) else layouts:
        local = layout.num_tokens // loaded.cp
        if max_tokens is not None and local > max_tokens:
            raise torch.cuda.OutOfMemoryError(
                f"skipped: {local} packed tokens per GPU > --max-tokens-per-gpu {max_tokens}"
            )
    from ps_bridge.runtime import row_logprobs

    device = loaded.device
    loaded.config.backend = backend
    layouts = [layouts] if not isinstance(layouts, (list, tuple)) else list(layouts)
    layouts = [layout.to(device) for layout in layouts]
    masks = [response_row_mask(layout).to(device) for layout in layouts]
    count = float(sum(mask.sum() for mask in masks))
    model = loaded.model
    timer = _Timer(device)
    holder = {}

    def logprob_pass():
        with torch.no_grad():
            holder["rows"] = [row_logprobs(loaded, layout, chunk_rows=chunk) for layout in layouts]

    def actor_step():
        run_actor_step(loaded, layouts, masks, count, chunk)

    def zero_grad():
        model.zero_grad(set_to_none=True)

    model.train()
    for _ in range(warmup):
        zero_grad()
        actor_step()
        logprob_pass()
        progress(1)
    zero_grad()
    actor_peak = _peak_mib(device, actor_step)
    logprob_peak = _peak_mib(device, logprob_pass)
    rows = torch.cat([r[mask] for r, mask in zip(holder["rows"], masks)]).float().cpu()
    actor_ms, logprob_ms = [], []
    for _ in range(repeats):
        zero_grad()
        actor_ms.append(timer.time(actor_step))
        logprob_ms.append(timer.time(logprob_pass))
        progress(1)
    zero_grad()
    return (
        ModeResult(
            tokens=sum(layout.tokens_shared for layout in layouts),  # packed tokens (= tokens_unshared when unshared)
            actor_ms=statistics.median(actor_ms),
            logprob_ms=statistics.median(logprob_ms),
            actor_peak_mib=actor_peak,
            logprob_peak_mib=logprob_peak,
            micro_batches=len(layouts),
        ),
        rows,
    )


def split_in_order(samples: list, parts: int) -> List[list]:
    """`samples` cut into `parts` consecutive pieces of near-equal size."""
    bounds = [round(i * len(samples) / parts) for i in range(parts + 1)]
    return [samples[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


# The unshared micro-batch is split into this many micro-batches when it does not fit at once.
UNSHARED_SPLITS = (1, 2, 4, 8, 16)


def run_unshared(loaded, samples: list, backend: str, **timing) -> Tuple[Optional[ModeResult], Optional[torch.Tensor], list]:
    """Time the unshared packing of `samples`, split into more and more micro-batches (`UNSHARED_SPLITS`)
    while one does not fit in GPU memory. Returns its timings and response log-probs, both None when
    it does not fit even split, and the layouts of the last attempt."""
    from ps_bridge.forward import cp_total_multiple
    from ps_bridge.layout import build_layout

    layouts: list = []
    for parts in (k for k in UNSHARED_SPLITS if k <= len(samples)):
        # At a 248k vocabulary, 16 x 4352 tokens of bf16 logits alone are 32 GiB: an unshared batch
        # that does not fit runs as `parts` micro-batches with gradient accumulation, as a trainer would.
        layouts = [build_layout(part, share=False, vocab_size=loaded.vocab_size, total_multiple=cp_total_multiple())
                   for part in split_in_order(samples, parts)]
        try:
            result, rows = run_mode(loaded, layouts, backend, **timing)
            return result, rows, layouts
        except torch.cuda.OutOfMemoryError:
            loaded.model.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return None, None, layouts
