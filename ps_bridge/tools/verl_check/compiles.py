"""Kernel compilations during a timed phase: Triton compiles a kernel once per new specialization of
its arguments (an integer's divisibility by 16, a pointer's alignment, ...), so a shape first met in a
later step costs that step a compile. verl-check records, per phase, how many kernels Triton compiled
and how long they took, to tell such one-off costs from the steady state (docs/how-it-works.md).

Uses Triton's JIT hooks (`ps_bridge.compat.triton.jit_runtime_hooks`: called before a compile and
after it); where Triton or the hooks are absent the counts are None. A kernel found in Triton's disk
cache still counts (it is loaded, not built: short). tilelang's compiles are not seen."""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Optional

from ps_bridge.compat.triton import jit_runtime_hooks


@contextlib.contextmanager
def counting_compiles() -> Iterator[Dict]:
    """Yields a dict filled on exit: `count` (kernels compiled or loaded), `seconds` (their total
    time), `kernels` (names, in order); all None where Triton's hooks are unavailable."""
    record: Dict = {"count": None, "seconds": None, "kernels": None}
    runtime = jit_runtime_hooks()
    if runtime is None:
        yield record
        return
    started: List[float] = []
    names: List[str] = []
    spent = [0.0]
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def on_start(**kw) -> Optional[bool]:
        started.append(time.perf_counter())
        return before(**kw) if before else None

    def on_end(**kw) -> Optional[bool]:
        if started:
            spent[0] += time.perf_counter() - started.pop()
        names.append(getattr(kw.get("fn"), "name", "?"))
        return after(**kw) if after else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_end
    try:
        yield record
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
        record.update(count=len(names), seconds=spent[0], kernels=names)
