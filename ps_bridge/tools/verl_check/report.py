"""verl-check's output for people (the per-step table) and for programs (the JSON document)."""

from __future__ import annotations

import json
import math

from ps_bridge.tools.verl_check.compare import relative_difference
from ps_bridge.tools.verl_check.config import PHASES


def write_json(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))


def system_prompt(cfg: dict) -> str:
    """The words before P in the report's first line: the system prompt's length and the prompts' images
    when the run has them (documents of older runs have no such keys)."""
    N = cfg.get("system_prompt_len") or 0
    images = cfg.get("images")
    text = f"system prompt {N} + " if N else ""
    if images:
        text += (f"{images['per_prompt']} image(s) of {images['size'][0]}x{images['size'][1]} pixels "
                 f"({images['tokens_per_image']} vision tokens each) + ")
    return text


def format_report(doc: dict) -> str:
    """The per-step table and the speed-up summary the command prints."""
    cfg, steps = doc["config"], doc["steps"]
    a, b = "stock", "shared"
    lines = [
        f"model {cfg['model']} ({cfg['dtype']}, {cfg['device']}); {cfg['prompts']} prompts x n={cfg['n']}, "
        f"{system_prompt(cfg)}P={cfg['prompt_len']}, R mean {cfg['response_len_mean']}; S = {cfg['ideal_speedup_S']:.2f}",
        f"stock engine: {cfg['stock_engine']}",
        f"prefix-shared engine: backend {cfg['shared_backend']}{', prefix trees' if cfg.get('tree') else ''}",
        "step  logp|d|   ref|d|    ent|d|    loss stock/shared         gnorm stock/shared        "
        "mb st/sh  t_old st/sh   t_ref st/sh   t_upd st/sh",
    ]

    def f(x, spec=".3g"):
        return "-" if x is None else format(x, spec)

    for s in steps:
        ps = s["phase_seconds"]
        lines.append(
            f"{s['step']:>4}  {s['logprob_max_abs_diff']:.2e}  {s['ref_logprob_max_abs_diff']:.2e}  "
            f"{s['entropy_max_abs_diff']:.2e}  {f(s['loss'][a], '.6g'):>11}/{f(s['loss'][b], '.6g'):<11}  "
            f"{f(s['grad_norm'][a], '.6g'):>11}/{f(s['grad_norm'][b], '.6g'):<11}  "
            f"{s['micro_batches'][a]:>3}/{s['micro_batches'][b]:<3}  "
            + "  ".join(f"{ps[a][ph]:6.2f}/{ps[b][ph]:<6.2f}" for ph in PHASES)
        )
    if "noise_floor" in doc:
        for s in doc["noise_floor"]["steps"]:
            ups = s["updates"]
            rel = max((relative_difference(u[k][a], u[k][b]) for u in ups for k in ("loss", "grad_norm")), default=0.0)
            lines.append(f"noise floor step {s['step']} (stock vs stock, budgets x 3/4): logp|d| "
                         f"{s['logprob_max_abs_diff']:.2e}, ref|d| {s['ref_logprob_max_abs_diff']:.2e}, "
                         f"ent|d| {s['entropy_max_abs_diff']:.2e}, loss/grad-norm rel {rel:.2e}, "
                         f"micro-batches {s['micro_batches'][a]}/{s['micro_batches'][b]}")
    lines.extend(compile_lines(steps, (a, b)))
    lines.extend(graph_lines(steps, (a, b)))
    sp, F = cfg["speedup"], cfg.get("flop_ratio_F")

    def versus_f(ph):
        return f", {sp[ph] / F[ph]:.2f} F" if F and F.get(ph) else ""

    lines.append("speed-up (stock time / shared time, steps after the first): "
                 + ", ".join(f"{ph} {sp[ph]:.2f}x ({sp[ph] / cfg['ideal_speedup_S']:.2f} S{versus_f(ph)})" for ph in PHASES))
    if F:
        lines.append("  F (stock's model FLOPs / those of the shared engine's micro-batches): "
                     + ", ".join(f"{ph} {F[ph]:.2f}" for ph in PHASES if ph in F))
    med = cfg.get("speedup_median")
    if med:
        lines.append("  of the per-step medians instead of the sums: " + ", ".join(f"{ph} {med[ph]:.2f}x" for ph in PHASES))
    peaks = [(s["peak_memory_gib"][a].get("update"), s["peak_memory_gib"][b].get("update")) for s in steps]
    if peaks and peaks[0][0] is not None:
        pa, pb = max(p[0] for p in peaks), max(p[1] for p in peaks)
        lines.append(f"update-phase peak memory: stock {pa:.2f} GiB, shared {pb:.2f} GiB ({pb / pa:.2f}x)")
    return "\n".join(lines)


def compile_lines(steps, kinds) -> list:
    """One line per timed step (after the first) in which Triton compiled kernels: a one-off cost that
    lands on whichever engine meets a new kernel specialization first."""
    lines = []
    for s in steps[1:]:
        for kind in kinds:
            for phase, c in (s.get("compiles") or {}).get(kind, {}).items():
                if c and c.get("count"):
                    names = sorted(set(c["kernels"]))
                    lines.append(f"  step {s['step']} {kind} {phase}: {c['count']} kernel compile(s), "
                                 f"{c['seconds']:.2f} s ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})")
    return (["Triton compiles in steps after the first:"] + lines) if lines else []


def graph_lines(steps, kinds) -> list:
    """CUDA graphs captured and replayed per engine and phase over all steps (`PS_BRIDGE_CUDA_GRAPHS=1`),
    where any was: a graph replays only micro-batches whose layout repeats one captured before; and the
    structures left eager because their graph would not fit the memory share."""
    lines = []
    for kind in kinds:
        totals: dict = {}
        for s in steps:
            for phase, c in (s.get("cuda_graphs") or {}).get(kind, {}).items():
                t = totals.setdefault(phase, {"captures": 0, "replays": 0, "no_room": 0})
                for k in t:
                    t[k] += (c or {}).get(k, 0)
        parts = [f"{phase} {t['captures']} captured / {t['replays']} replayed"
                 + (f" / {t['no_room']} left eager (PS_BRIDGE_CUDA_GRAPH_MEMORY)" if t["no_room"] else "")
                 for phase, t in totals.items() if t["captures"] or t["replays"] or t["no_room"]]
        if parts:
            lines.append(f"CUDA graphs, {kind} engine: " + ", ".join(parts))
    return lines
