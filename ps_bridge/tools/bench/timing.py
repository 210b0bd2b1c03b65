"""How a packing of a micro-batch is timed: CUDA events (wall clock on a CPU) after warm-up, median
of repeats, torch's peak allocated memory of one step; the actor step and the log-prob pass; and
the unshared baseline split into micro-batches (gradient accumulation) when it does not fit at once;
two packings of one micro-batch timed against each other, interleaved (`run_pair`).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ps_bridge.compat.megatron_core import release_failed_forward
from ps_bridge.forward import cp_total_multiple
from ps_bridge.layout import build_layout
from ps_bridge.parallel.gradients import finish_gradients
from ps_bridge.tools.bench.catalog import response_row_mask
from ps_bridge.tools.runtime import row_logprobs
from ps_bridge.tree.split import budget_micro_batches


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
    for layout, mask in zip(layouts, masks):
        rows = row_logprobs(loaded, layout, chunk_rows=chunk)  # gradient to this CP rank's own rows
        (-(rows * mask).sum() / count * loaded.cp).backward()
    if loaded.cp > 1 or loaded.ep > 1:
        finish_gradients(loaded.model, loaded.provider, data_parallel_mean=True)


class _Packing:
    """One packing of the micro-batch, ready to time: its layouts on the device, the response-row
    masks, the actor step and the log-prob pass (the rows of the last pass kept)."""

    def __init__(self, loaded, layouts, chunk: int):
        device = loaded.device
        self.loaded, self.chunk = loaded, chunk
        self.layouts = [layout.to(device) for layout in (layouts if isinstance(layouts, (list, tuple)) else [layouts])]
        self.masks = [response_row_mask(layout).to(device) for layout in self.layouts]
        self.count = float(sum(mask.sum() for mask in self.masks))
        self.rows = None

    def logprob_pass(self):
        with torch.no_grad():
            self.rows = [row_logprobs(self.loaded, layout, chunk_rows=self.chunk) for layout in self.layouts]

    def actor_step(self):
        run_actor_step(self.loaded, self.layouts, self.masks, self.count, self.chunk)

    def zero_grad(self):
        self.loaded.model.zero_grad(set_to_none=True)

    def warm_up(self, steps: int, progress) -> None:
        for _ in range(steps):
            self.zero_grad()
            self.actor_step()
            self.logprob_pass()
            progress(1)

    def peaks(self) -> Tuple[Optional[float], Optional[float]]:
        """Peak memory (MiB) of one actor step and one log-prob pass; the response rows kept."""
        self.zero_grad()
        device = self.loaded.device
        return _peak_mib(device, self.actor_step), _peak_mib(device, self.logprob_pass)

    def response_rows(self) -> torch.Tensor:
        return torch.cat([r[mask] for r, mask in zip(self.rows, self.masks)]).float().cpu()

    def time_once(self, timer: "_Timer") -> Tuple[float, float]:
        """One actor step and one log-prob pass, timed (ms)."""
        self.zero_grad()
        return timer.time(self.actor_step), timer.time(self.logprob_pass)

    def result(self, actor_ms: List[float], logprob_ms: List[float], peaks) -> ModeResult:
        return ModeResult(
            tokens=sum(layout.tokens_shared for layout in self.layouts),  # packed tokens (= tokens_unshared when unshared)
            actor_ms=statistics.median(actor_ms),
            logprob_ms=statistics.median(logprob_ms),
            actor_peak_mib=peaks[0],
            logprob_peak_mib=peaks[1],
            micro_batches=len(self.layouts),
        )


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
    loaded.config.backend = backend
    packing = _Packing(loaded, layouts, chunk)
    timer = _Timer(loaded.device)
    loaded.model.train()
    packing.warm_up(warmup, progress)
    peaks = packing.peaks()
    rows = packing.response_rows()
    actor_ms, logprob_ms = [], []
    for _ in range(repeats):
        actor, logprob = packing.time_once(timer)
        actor_ms.append(actor), logprob_ms.append(logprob)
        progress(1)
    packing.zero_grad()
    return packing.result(actor_ms, logprob_ms, peaks), rows


def run_pair(loaded, first, second, backend: str, warmup: int, repeats: int, chunk: int, progress
             ) -> Tuple[ModeResult, torch.Tensor, ModeResult, torch.Tensor]:
    """Time two packings of the same micro-batch against each other, interleaved: each repeat runs
    both, in turns (first-second, then second-first, ...), so that drift of the GPU's clocks or of the
    host affects both alike (their difference may be a few per cent). Returns each one's timings and
    response log-probs, as `run_mode`."""
    loaded.config.backend = backend
    packings = [_Packing(loaded, first, chunk), _Packing(loaded, second, chunk)]
    timer = _Timer(loaded.device)
    loaded.model.train()
    for packing in packings:
        packing.warm_up(warmup, progress)
    peaks = [packing.peaks() for packing in packings]
    rows = [packing.response_rows() for packing in packings]
    times = [([], []), ([], [])]
    for k in range(repeats):
        for i in ((0, 1) if k % 2 == 0 else (1, 0)):
            actor, logprob = packings[i].time_once(timer)
            times[i][0].append(actor), times[i][1].append(logprob)
            progress(1)
    packings[0].zero_grad()
    a, b = (packing.result(*t, p) for packing, t, p in zip(packings, times, peaks))
    return a, rows[0], b, rows[1]


def split_in_order(samples: list, parts: int) -> List[list]:
    """`samples` cut into `parts` consecutive pieces of near-equal size."""
    bounds = [round(i * len(samples) / parts) for i in range(parts + 1)]
    return [samples[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


# The unshared micro-batch is split into this many micro-batches when it does not fit at once.
UNSHARED_SPLITS = (1, 2, 4, 8, 16)


def _first_that_fits(loaded, candidates, backend: str, **timing):
    """Time the first packing of `candidates` (each a list of layouts, finer and finer splits) that
    fits in GPU memory: (its timings, its response log-probs, its layouts, its index, ""), or (None,
    None, the last layouts tried, -1, the first line of the last out-of-memory error: torch's says how
    much it tried to allocate and how much was free) when none fits. Out of memory, the gradients and
    cached blocks of the failed attempt are released before the next."""
    layouts: list = []
    last_error = ""
    for index, layouts in enumerate(candidates):
        try:
            result, rows = run_mode(loaded, layouts if len(layouts) > 1 else layouts[0], backend, **timing)
            return result, rows, layouts, index, ""
        except torch.cuda.OutOfMemoryError as e:
            last_error = str(e).splitlines()[0] if str(e) else ""
        # out of the except block: the exception's traceback holds the failed attempt's frames (its
        # activations) until it is dropped, and reference cycles through such frames until the
        # collector runs, so only now can their memory be freed and handed back
        release_failed_forward(loaded.model)
        loaded.model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return None, None, layouts, -1, last_error


def run_unshared(loaded, samples: list, backend: str, **timing) -> Tuple[Optional[ModeResult], Optional[torch.Tensor], list]:
    """Time the unshared packing of `samples`, split into more and more micro-batches (`UNSHARED_SPLITS`)
    while one does not fit in GPU memory. Returns its timings and response log-probs, both None when
    it does not fit even split, and the layouts of the last attempt."""
    # At a 248k vocabulary, 16 x 4352 tokens of bf16 logits alone are 32 GiB: an unshared batch
    # that does not fit runs as `parts` micro-batches with gradient accumulation, as a trainer would.
    candidates = ([build_layout(part, share=False, vocab_size=loaded.vocab_size, total_multiple=cp_total_multiple())
                   for part in split_in_order(samples, parts)]
                  for parts in UNSHARED_SPLITS if parts <= len(samples))
    result, rows, layouts, _, _ = _first_that_fits(loaded, candidates, backend, **timing)
    return result, rows, layouts


# The shared micro-batch is split into at most this many micro-batches when it does not fit at once.
SHARED_SPLITS = (1, 2, 4, 8)


def run_shared(loaded, samples: list, layout, pack, backend: str, **timing) -> Tuple[ModeResult, torch.Tensor, list]:
    """Time the shared packing `layout` of `samples`; when it does not fit in GPU memory at once (a
    248k vocabulary's logits of 88k read positions are 44 GB), its samples in micro-batches of at most
    1/k of its packed tokens for k in `SHARED_SPLITS` (`tree.split.budget_micro_batches`: each shared
    prefix in as few micro-batches as fit, computed once in each, as the verl engine's micro-batching
    splits a subtree over its budget; `pack` packs one), with gradient accumulation. Returns its
    timings, its response log-probs in the samples' order, and the layouts it ran."""
    splits: List[List[List[int]]] = []  # per candidate, each micro-batch's sample indices

    def candidates():
        for parts in SHARED_SPLITS:
            if parts == 1:
                groups = [list(range(len(samples)))]
            else:
                try:
                    groups = budget_micro_batches(layout, -(-layout.num_tokens // parts))
                except ValueError:  # a sample longer than the budget: no finer split
                    return
            splits.append(groups)
            yield [layout] if parts == 1 else [pack([samples[i] for i in group]) for group in groups]

    result, rows, layouts, index, error = _first_that_fits(loaded, candidates(), backend, **timing)
    if result is None:
        raise torch.cuda.OutOfMemoryError(
            f"the shared micro-batch did not fit in GPU memory even as {len(layouts)} micro-batches ({error})")
    return result, _in_sample_order(rows, samples, splits[index]), layouts


def _in_sample_order(rows: torch.Tensor, samples: list, groups: List[List[int]]) -> torch.Tensor:
    """Response rows concatenated micro-batch by micro-batch (`groups`: each one's sample indices, in
    its order) put back in the samples' order."""
    order = [i for group in groups for i in group]
    if order == list(range(len(samples))):
        return rows
    pieces = rows.split([len(samples[i].response) for i in order])
    by_sample = dict(zip(order, pieces))
    return torch.cat([by_sample[i] for i in range(len(samples))])

