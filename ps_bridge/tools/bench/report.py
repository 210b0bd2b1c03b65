"""The bench's results and how they are reported: the per-row result, the table, the plot, the
environment and the JSON payload."""

from __future__ import annotations

import importlib.metadata as md
import math
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

import torch

from ps_bridge.tools.bench.catalog import ideal_speedup
from ps_bridge.tools.bench.timing import ModeResult


@dataclass
class RowCoordinates:
    """Which model, backend and micro-batch shape a row measured (the first fields of every row)."""

    model: str
    layers: int
    backend: str
    P: int
    R: int
    n: int
    groups: int


@dataclass
class RowResult(RowCoordinates):
    tokens_unshared: int
    tokens_shared: int
    ideal_speedup: float
    actor_speedup: float
    logprob_speedup: float
    actor_peak_ratio: Optional[float]
    unshared: ModeResult
    shared: ModeResult
    unshared_tokens_per_s: float
    shared_tokens_per_s: float
    max_logprob_diff: float
    error: Optional[str] = None
    unshared_out_of_memory: bool = False  # the unshared batch did not fit even split; shared timed alone
    # with --fp32-reference: ||lp - lp_fp32|| / ||lp_fp32|| over response tokens, and the max |lp - lp_fp32|
    shared_rel_err_fp32: Optional[float] = None
    unshared_rel_err_fp32: Optional[float] = None
    shared_max_err_fp32: Optional[float] = None
    unshared_max_err_fp32: Optional[float] = None
    # the processes of the run: world_size, cp, ep, data_parallel, groups_per_rank (EP: each rank's whole groups)
    parallel: Optional[dict] = None
    # a tree row (`--trees`): the shape's name (P = R = n = 0); the shared layout's tree depth and node count
    tree: Optional[str] = None
    tree_depth: Optional[int] = None
    nodes: Optional[int] = None
    # F: model FLOPs of the unshared computation over those of the shared one (bench/flops.py)
    flop_ratio: Optional[float] = None
    # how the shared run packed: "tree" (every common prefix, the default) or "prompt" (one level, --no-tree)
    share: Optional[str] = None
    # an image row (`--images`): the prompts' images, the vision tower's runs and FLOPs (bench/run.py image_row)
    images: Optional[dict] = None
    # what the sharing rule decides for the row's micro-batch (bench/run.py rule_decisions): "actor" and
    # "logprob" ("shared", "unshared", or "not applied" where it has no cost for the kernels or device),
    # with their reasons
    rule: Optional[dict] = None

    @classmethod
    def failed(cls, model: str, layers: int, backend: str, P: int, R: int, n: int, groups: int, error: str,
               tree: Optional[str] = None) -> "RowResult":
        """A row that raised (the other rows still run): only its coordinates and the error."""
        def no_mode():
            return ModeResult(0, math.nan, math.nan, None, None)

        ideal = math.nan if tree else ideal_speedup(P, R, n)
        return cls(model, layers, backend, P, R, n, groups, 0, 0, ideal, math.nan, math.nan, None,
                   no_mode(), no_mode(), math.nan, math.nan, math.nan, error=error, tree=tree)

    @property
    def coordinates(self) -> tuple:
        """The table's P, R, n cells: the numbers, or the tree shape's name (an image row's P: the whole
        prompt, its text tokens in brackets)."""
        if self.tree:
            return (self.tree, "-", "-")
        P = f"{self.images['prompt_tokens']} ({self.P} text)" if self.images else str(self.P)
        return (P, str(self.R), str(self.n))


@dataclass
class MinSharedRow(RowCoordinates):
    """A `--min-shared-sweep` row: one micro-batch whose prompts share only a leading run of `run`
    tokens (`catalog.template_samples`), packed as a token trie twice: at `min_shared=0` (the run
    shared: one more tree level) and at `min_shared=run + 1` (the run computed in every prompt);
    `actor_x` / `logprob_x` are the second's time over the first's (> 1: sharing the run pays)."""

    run: int
    tokens_shared_run: int  # trie tokens with the run shared (min_shared=0)
    tokens_unshared_run: int  # trie tokens with the run in every prompt (min_shared=run + 1)
    depth_shared_run: int
    depth_unshared_run: int
    nodes_shared_run: int
    nodes_unshared_run: int
    shared_run: ModeResult
    unshared_run: ModeResult
    actor_x: float
    logprob_x: float
    max_logprob_diff: float
    error: Optional[str] = None

    @classmethod
    def failed(cls, model: str, layers: int, backend: str, P: int, R: int, n: int, groups: int, run: int,
               error: str) -> "MinSharedRow":
        none = ModeResult(0, math.nan, math.nan, None, None)
        return cls(model, layers, backend, P, R, n, groups, run, 0, 0, 0, 0, 0, 0, none, none, math.nan, math.nan,
                   math.nan, error=error)


def format_min_shared_table(rows: Sequence[MinSharedRow]) -> str:
    """The `--min-shared-sweep` table: per row the run length k, the two packings' trie tokens, depth and
    nodes (k shared / k not shared), their median times and x = not shared / shared (> 1: sharing pays)."""
    head = ("model", "layers", "backend", "P", "R", "n", "groups", "run k", "trie tok (k sh / not)",
            "depth", "nodes", "actor ms (k sh / not)", "actor x", "logprob ms (k sh / not)", "logprob x",
            "max |dlogp|")
    lines = []
    for r in rows:
        coordinates = (r.model, str(r.layers), r.backend, str(r.P), str(r.R), str(r.n), str(r.groups), str(r.run))
        if r.error:
            lines.append(coordinates + ("-",) * 7 + (f"ERROR {r.error}",))
            continue
        lines.append(coordinates + (
            f"{r.tokens_shared_run} / {r.tokens_unshared_run}", f"{r.depth_shared_run} / {r.depth_unshared_run}",
            f"{r.nodes_shared_run} / {r.nodes_unshared_run}",
            f"{r.shared_run.actor_ms:.2f} / {r.unshared_run.actor_ms:.2f}", f"{r.actor_x:.3f}",
            f"{r.shared_run.logprob_ms:.2f} / {r.unshared_run.logprob_ms:.2f}", f"{r.logprob_x:.3f}",
            f"{r.max_logprob_diff:.2e}",
        ))
    return _markdown(head, lines)


def _markdown(head: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [fmt(line) for line in lines]
    return "\n".join(out)


RULE_SHORT = {"shared": "sh", "unshared": "un", "not applied": "n/a"}


def rule_cell(rule: Optional[dict]) -> str:
    """The table's rule cell: the decision with the backward / without it (`sh`, `un`, `n/a`)."""
    return "-" if rule is None else f"{RULE_SHORT[rule['actor']]}/{RULE_SHORT[rule['logprob']]}"


def format_table(results: Sequence[RowResult]) -> str:
    head = ("model", "layers", "backend", "P", "R", "n", "tok unsh", "tok sh (trie)", "ideal S", "F", "actor x",
            "x/S", "x/F", "logprob x", "rule", "peak unsh GiB", "peak sh GiB", "peak ratio", "tok/s unsh", "tok/s sh",
            "max |dlogp|")
    with_fp32 = any(r.shared_rel_err_fp32 is not None for r in results)
    if with_fp32:
        head += ("rel err sh vs fp32", "rel err unsh vs fp32", "max err sh", "max err unsh")
    lines = []
    for r in results:
        if r.error:
            line = (r.model, str(r.layers), r.backend) + r.coordinates + ("-",) * 14 + (f"ERROR {r.error}",)
            lines.append(line + ("-",) * 4 if with_fp32 else line)
            continue
        missing = "OOM" if r.unshared_out_of_memory else "-"  # what a value that needs the unshared run shows

        def cell(x, spec):
            return missing if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

        lines.append((
            r.model, str(r.layers), r.backend, *r.coordinates,
            str(r.tokens_unshared), str(r.tokens_shared), f"{r.ideal_speedup:.2f}", cell(r.flop_ratio, ".2f"),
            cell(r.actor_speedup, ".2f"), cell(r.actor_speedup / r.ideal_speedup, ".2f"),
            cell(r.actor_speedup / r.flop_ratio if r.flop_ratio else None, ".2f"), cell(r.logprob_speedup, ".2f"),
            rule_cell(r.rule), cell(r.unshared.actor_peak_mib and r.unshared.actor_peak_mib / 1024, ".2f"),
            cell(r.shared.actor_peak_mib and r.shared.actor_peak_mib / 1024, ".2f"),
            cell(r.actor_peak_ratio, ".2f"), cell(r.unshared_tokens_per_s, ",.0f"),
            cell(r.shared_tokens_per_s, ",.0f"), cell(r.max_logprob_diff, ".2e"),
        ) + (tuple(cell(x, ".2e") for x in (r.shared_rel_err_fp32, r.unshared_rel_err_fp32,
                                            r.shared_max_err_fp32, r.unshared_max_err_fp32))
             if with_fp32 else ()))
    return _markdown(head, lines)


def write_plot(results: Sequence[RowResult], path: str) -> None:
    try:
        # imported here: matplotlib is optional (the plot extra)
        import matplotlib

        matplotlib.use("Agg")
        # imported here: matplotlib is optional (the plot extra)
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from None
    ok = [r for r in results if not r.error and not r.unshared_out_of_memory]
    labels = [f"{r.model}\n{r.backend}\n" + (r.tree or f"P={r.P} R={r.R} n={r.n}") for r in ok]
    x = range(len(ok))
    width = 0.27
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(ok)), 4.8))
    ax.bar([i - width for i in x], [r.ideal_speedup for r in ok], width, label="ideal S = unshared / shared tokens", color="#bbbbbb")
    ax.bar(list(x), [r.actor_speedup for r in ok], width, label="actor step (fwd+bwd)", color="#1f77b4")
    ax.bar([i + width for i in x], [r.logprob_speedup for r in ok], width, label="log-prob pass (fwd)", color="#ff7f0e")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("speed-up, prefix-shared vs unshared")
    ax.set_title("ps-bridge bench: measured vs ideal speed-up")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device: torch.device) -> dict:
    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    env = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=version("triton"),
        megatron_core=version("megatron-core") or version("megatron_core"),
        megatron_bridge=version("megatron-bridge") or version("megatron_bridge"),
        flash_attn=version("flash-attn") or version("flash_attn"),
        transformers=version("transformers"),
    )
    return env


# ---- entry point ------------------------------------------------------------------------------------


def payload(env: dict, dtype: torch.dtype, warmup: int, repeats: int, groups: int, models: List[str],
            results: Sequence[RowResult], min_shared_rows: Optional[Sequence[MinSharedRow]] = None,
            cuda_graphs: bool = False) -> dict:
    """What `--json` writes (`min_shared_rows` only for a `--min-shared-sweep` run)."""
    out = dict(environment=env, dtype=str(dtype), warmup=warmup, repeats=repeats, groups=groups,
               cuda_graphs=cuda_graphs, models=models, rows=[asdict(r) for r in results])
    if min_shared_rows is not None:
        out["min_shared_rows"] = [asdict(r) for r in min_shared_rows]
    return out
