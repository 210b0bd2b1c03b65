"""Stock vs shared, per step: the JSON record, the speed-ups, and what the fp32 smoke requires."""

from __future__ import annotations

import statistics
from typing import Dict, List

import torch

from ps_bridge.tools.verl_check.config import PHASES


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def compare(stock: List[dict], shared: List[dict], names=("stock", "shared")) -> List[dict]:
    """Per step, one JSON record of both engines: the largest log-prob / entropy differences, losses,
    gradient norms, KL, phase times, micro-batch counts, peak memory, compiles and FLOPs."""
    steps = []
    a, b = names
    for t, (s, p) in enumerate(zip(stock, shared)):
        updates = [{"loss": {a: ls, b: lp}, "grad_norm": {a: gs, b: gp}}
                   for ls, lp, gs, gp in zip(s["losses"], p["losses"], s["grad_norms"], p["grad_norms"])]
        last = updates[-1] if updates else {"loss": {a: None, b: None}, "grad_norm": {a: None, b: None}}
        steps.append({
            "step": t + 1,
            "logprob_max_abs_diff": _max_abs(s["old"], p["old"]),
            "ref_logprob_max_abs_diff": _max_abs(s["ref"], p["ref"]),
            "entropy_max_abs_diff": _max_abs(s["entropy"], p["entropy"]),
            "loss": last["loss"],
            "grad_norm": last["grad_norm"],
            "updates": updates,
            "kl": {a: s["kl"], b: p["kl"]},
            "phase_seconds": {a: s["phase_seconds"], b: p["phase_seconds"]},
            "micro_batches": {a: sum(s["micro_batches"].values()), b: sum(p["micro_batches"].values())},
            "peak_memory_gib": {a: s["peak_memory_gib"], b: p["peak_memory_gib"]},
            "compiles": {a: s.get("compiles", {}), b: p.get("compiles", {})},
            "cuda_graphs": {a: s.get("cuda_graphs", {}), b: p.get("cuda_graphs", {})},
            "flops": {a: s.get("flops") or None, b: p.get("flops") or None},
        })
    return steps


def speedups(steps: List[dict], names=("stock", "shared"), skip_first: bool = True,
             statistic: str = "sum") -> Dict[str, float]:
    """Per phase, stock time / shared time over the steps (the first left out when there are more: it
    carries one-off compilation and autotuning): of their sums (`statistic="sum"`), or of their
    medians (`"median"`: a one-off event in a later step, such as a kernel compiled for a shape first
    met there, which lands on whichever engine meets the shape first, does not decide)."""
    if statistic not in ("sum", "median"):
        raise ValueError(f"statistic {statistic!r}: use 'sum' or 'median'")
    reduce = sum if statistic == "sum" else statistics.median
    a, b = names
    use = steps[1:] if skip_first and len(steps) > 1 else steps
    out = {}
    for ph in PHASES:
        ta = reduce([s["phase_seconds"][a][ph] for s in use])
        tb = reduce([s["phase_seconds"][b][ph] for s in use])
        out[ph] = ta / tb if tb > 0 else float("nan")
    return out


def relative_difference(a: float, b: float, floor: float = 1e-6) -> float:
    """|a - b| relative to the larger magnitude; below `floor` (a loss whose terms cancel, e.g. GRPO
    advantages summing to 0 over a mini-batch at ratio 1) the difference counts absolutely."""
    return abs(a - b) / max(abs(a), abs(b), floor)


def check_failures(doc: dict, logprob_tol: float = 1e-5, rel_tol: float = 1e-5) -> List[str]:
    """What the fp32 smoke requires, as messages (empty when it holds)."""
    bad = []

    rel = relative_difference

    for s in doc["steps"]:
        t = s["step"]
        for key in ("logprob_max_abs_diff", "ref_logprob_max_abs_diff"):
            if not s[key] <= logprob_tol:
                bad.append(f"step {t}: {key} {s[key]:.3g} > {logprob_tol}")
        for u, upd in enumerate(s["updates"]):
            for key in ("loss", "grad_norm"):
                a, b = upd[key]["stock"], upd[key]["shared"]
                if not rel(a, b) <= rel_tol:
                    bad.append(f"step {t} update {u + 1}: {key} stock {a:.8g} vs shared {b:.8g}")
        if not s["micro_batches"]["shared"] <= s["micro_batches"]["stock"]:
            bad.append(f"step {t}: shared ran {s['micro_batches']['shared']} micro-batches, stock "
                       f"{s['micro_batches']['stock']}")
    return bad
