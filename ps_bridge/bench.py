"""`ps-bridge bench`: how much faster is a prefix-shared step than the unshared one, on a GPU.

One process builds each requested model shape through our Megatron-Bridge provider (random weights,
the real hidden size, heads and head dim of the named checkpoint, possibly fewer layers: the count
is printed), and for each grid row (prompt length P, response length R, n responses per prompt)
times, on the *same* micro-batch packed shared and unshared:

- the actor step: forward, per-sample log-probs, a masked log-prob loss, backward;
- the log-prob pass: forward and log-probs, no gradient (the old/ref log-prob pass of GRPO).

Timing is with CUDA events after warm-up, median of repeats; the micro-batch's layout is built
before timing (verl prepares it on the host while the GPU works). Peak memory is torch's peak
allocated bytes during one actor step. The ideal speed-up is the token ratio S = n(P+R)/(P+nR);
tokens/s counts the micro-batch's unshared tokens n(P+R), so it is comparable between the modes.

Model shapes are table entries (`MODEL_SHAPES`), built by their family's HF-config builder
(`FAMILIES`): a new family (Qwen3.5) adds one builder and its shapes.

`--smoke` runs tiny shapes (on a CPU too, with wall-clock timing) so CI exercises the whole path.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

# ---- what is measured ------------------------------------------------------------------------


def qwen2_hf_config(dims: dict, num_layers: int):
    from transformers import Qwen2Config

    cfg = Qwen2Config(**dict(dims, num_hidden_layers=num_layers))
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def qwen35_hf_config(dims: dict, num_layers: int):
    """Qwen3.5 text model (`Qwen3_5ForCausalLM`): the hybrid pattern of the real checkpoint
    (three Gated DeltaNet layers, then one full-attention layer) cut to `num_layers`."""
    from transformers import Qwen3_5TextConfig

    layer_types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(num_layers)]
    cfg = Qwen3_5TextConfig(**dict(dims, num_hidden_layers=num_layers, layer_types=layer_types))
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


# family -> builder(real dims, number of layers) -> transformers config our provider registry serves.
FAMILIES: Dict[str, Callable] = {"qwen2.5": qwen2_hf_config, "qwen3.5": qwen35_hf_config}


@dataclass(frozen=True)
class ModelShape:
    family: str
    dims: dict  # the checkpoint's config.json values that set the shape
    full_layers: int
    bench_layers: int  # default layer count for the bench (fewer layers keep a grid row quick)


_QWEN25_COMMON = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)

_QWEN35_COMMON = dict(
    vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6, max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
)

MODEL_SHAPES: Dict[str, ModelShape] = {
    "qwen2.5-1.5b": ModelShape(
        "qwen2.5",
        dict(_QWEN25_COMMON, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
             num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
        full_layers=28,
        bench_layers=8,
    ),
    "qwen2.5-7b": ModelShape(
        "qwen2.5",
        dict(_QWEN25_COMMON, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
             num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
        full_layers=28,
        bench_layers=4,
    ),
    # Qwen3.5 text models (values of the released config.json files; GDN + gated attention)
    "qwen3.5-0.8b": ModelShape(
        "qwen3.5",
        dict(_QWEN35_COMMON, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
             num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True),
        full_layers=24,
        bench_layers=8,
    ),
    "qwen3.5-9b": ModelShape(
        "qwen3.5",
        dict(_QWEN35_COMMON, hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
             num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False),
        full_layers=32,
        bench_layers=4,
    ),
    "tiny-qwen3.5": ModelShape(
        "qwen3.5",
        dict(_QWEN35_COMMON, vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512, tie_word_embeddings=False),
        full_layers=4,
        bench_layers=4,
    ),
    # --smoke: Qwen2-shaped and tiny
    "tiny-qwen2.5": ModelShape(
        "qwen2.5",
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False),
        full_layers=2,
        bench_layers=2,
    ),
}

DEFAULT_MODELS = ("qwen2.5-1.5b", "qwen2.5-7b", "qwen3.5-0.8b", "qwen3.5-9b")
DEFAULT_GRID: Tuple[Tuple[int, int, int], ...] = ((2048, 512, 8), (4096, 256, 16), (1024, 1024, 8), (512, 4096, 8))
SMOKE_GRID: Tuple[Tuple[int, int, int], ...] = ((24, 8, 4), (8, 24, 2))


def ideal_speedup(P: int, R: int, n: int) -> float:
    return n * (P + R) / (P + n * R)


# ---- arguments --------------------------------------------------------------------------------


def _parse_grid(text: str) -> List[Tuple[int, int, int]]:
    rows = []
    for part in text.replace(" ", "").split(";"):
        if not part:
            continue
        try:
            P, R, n = (int(x) for x in part.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"grid row {part!r} is not 'P,R,n' (three integers)") from None
        if min(P, R, n) < 1:
            raise argparse.ArgumentTypeError(f"grid row {part!r}: P, R and n must be >= 1")
        rows.append((P, R, n))
    if not rows:
        raise argparse.ArgumentTypeError("the grid is empty")
    return rows


def _parse_list(text: str) -> List[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=_parse_list, default=None,
                        help=f"comma-separated model shapes ({', '.join(MODEL_SHAPES)}); default "
                        f"{','.join(DEFAULT_MODELS)} (tiny-qwen2.5,tiny-qwen3.5 with --smoke)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of every model (default: each shape's bench default, printed)")
    parser.add_argument("--grid", type=_parse_grid, default=None,
                        help="rows 'P,R,n;P,R,n;...' (default: 2048,512,8;4096,256,16;1024,1024,8;512,4096,8)")
    parser.add_argument("--groups", type=int, default=1, help="prompts (groups of n responses) per micro-batch")
    parser.add_argument("--backends", type=_parse_list, default=["auto"],
                        help="comma-separated attention backends to time prefix-shared (default auto); "
                        "the unshared baseline uses the first")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps; the median is reported (default 5)")
    parser.add_argument("--logprob-chunk", type=int, default=1024,
                        help="rows per float32 log-softmax chunk (default 1024; 0.6 GB at a 152k vocabulary)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="also write the results as JSON to FILE (stdout when FILE is omitted)")
    parser.add_argument("--plot", default=None, metavar="FILE", help="write a PNG of measured vs ideal speed-up")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and grid, few repeats; runs on a CPU (for CI)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="also compare both bf16 runs with a float32 reference on the same weights (unshared "
                             "packing, torch_ref kernels, TF32 off): relative error of the response log-probs")


# ---- one grid row ------------------------------------------------------------------------------


@dataclass
class ModeResult:
    tokens: int
    actor_ms: float
    logprob_ms: float
    actor_peak_mib: Optional[float]
    logprob_peak_mib: Optional[float]
    micro_batches: int = 1  # >1: the batch did not fit at once and ran split (gradient accumulation)


@dataclass
class RowResult:
    model: str
    layers: int
    backend: str
    P: int
    R: int
    n: int
    groups: int
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


def make_samples(P: int, R: int, n: int, groups: int, vocab: int, seed: int):
    from ps_bridge.layout import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(groups):
        prompt = torch.randint(vocab, (P,), generator=g).tolist()
        for _ in range(n):
            samples.append(Sample(prompt, torch.randint(vocab, (R,), generator=g).tolist()))
    return samples


def response_row_mask(layout) -> torch.Tensor:
    """True at the row positions that hold a response token's log-prob (P-1 .. P+R-2 per sample)."""
    mask = torch.zeros(int(layout.row_offsets[-1]), dtype=torch.bool)
    offsets = layout.row_offsets.tolist()
    for i in range(layout.num_samples):
        P = int(layout.sample_prompt_length[i])
        R = int(layout.sample_response_length[i])
        mask[offsets[i] + P - 1 : offsets[i] + P - 1 + R] = True
    return mask


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
    and the backward of a masked mean log-prob loss over the `count` response tokens of all of them."""
    from ps_bridge.logprobs import packed_row_logprobs_chunked
    from ps_bridge.runtime import forward_logits

    for layout, mask in zip(layouts, masks):
        rows = packed_row_logprobs_chunked(forward_logits(loaded, layout), layout, chunk)
        (-(rows * mask).sum() / count).backward()


def run_mode(loaded, layouts, backend: str, warmup: int, repeats: int, chunk: int, progress) -> Tuple[ModeResult, torch.Tensor]:
    """Time one packing of the micro-batch; returns its timings and its response log-probs.

    `layouts` is one layout, or several that split the samples in order: then one actor step runs
    them as consecutive micro-batches with gradient accumulation (how a trainer runs a batch that does
    not fit at once), and the log-prob pass runs each of them."""
    from ps_bridge.logprobs import packed_row_logprobs_chunked
    from ps_bridge.runtime import forward_logits

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
            holder["rows"] = [packed_row_logprobs_chunked(forward_logits(loaded, layout), layout, chunk)
                              for layout in layouts]

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
UNSHARED_SPLITS = (1, 2, 4, 8)


class Fp32Reference:
    """The bench model's own weights in a float32 twin (`runtime.float32_reference_model`: torch_ref
    kernels), run with TF32 off on the *unshared* packing: the computation bf16 approximates, so a
    shared and an unshared bf16 run are each judged by their distance to it, not only by their
    distance to each other. Slow for Qwen3.5 (torch_ref's GDN recurrence runs token by token)."""

    def __init__(self, hf_config, loaded, chunk: int):
        from ps_bridge.runtime import float32_reference_model

        self.loaded = float32_reference_model(loaded, hf_config)
        self.chunk = chunk

    def response_logprobs(self, unshared_layouts) -> torch.Tensor:
        """Response-token log-probs over the unshared micro-batches, in sample order."""
        from ps_bridge.logprobs import packed_row_logprobs_chunked
        from ps_bridge.runtime import forward_logits, tf32_disabled

        out = []
        with tf32_disabled(), torch.no_grad():
            for layout in unshared_layouts:
                layout = layout.to(self.loaded.device)
                mask = response_row_mask(layout).to(self.loaded.device)
                out.append(packed_row_logprobs_chunked(forward_logits(self.loaded, layout), layout, self.chunk)[mask])
        return torch.cat(out).double().cpu()


def _errors_against(reference: torch.Tensor, rows: torch.Tensor) -> Tuple[float, float]:
    diff = rows.double() - reference
    return float(diff.norm() / reference.norm()), float(diff.abs().max())


def run_row(loaded, model_name, layers, backends, P, R, n, args, progress, reference=None) -> List[RowResult]:
    from ps_bridge.layout import build_layout

    samples = make_samples(P, R, n, args.groups, loaded.vocab_size, args.seed)
    shared_layout = build_layout(samples, share=True, vocab_size=loaded.vocab_size)
    common = dict(warmup=args.warmup, repeats=args.repeats, chunk=args.logprob_chunk, progress=progress)
    base = base_rows = None
    for parts in (k for k in UNSHARED_SPLITS if k <= len(samples)):
        # At a 248k vocabulary, 16 x 4352 tokens of bf16 logits alone are 32 GiB: an unshared batch
        # that does not fit runs as `parts` micro-batches with gradient accumulation, as a trainer would.
        layouts = [build_layout(part, share=False, vocab_size=loaded.vocab_size) for part in split_in_order(samples, parts)]
        try:
            base, base_rows = run_mode(loaded, layouts, backends[0], **common)
            break
        except torch.cuda.OutOfMemoryError:
            loaded.model.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if base is None:  # not even split: time the shared packing alone
        base = ModeResult(shared_layout.tokens_unshared, math.nan, math.nan, None, None, micro_batches=0)
    reference_rows = None
    if reference is not None and base_rows is not None:  # on the same micro-batches as the unshared run
        reference_rows = reference.response_logprobs(layouts)
    results = []
    for backend in backends:
        shared, rows = run_mode(loaded, shared_layout, backend, **common)
        fp32 = {}
        if reference_rows is not None:
            fp32["shared_rel_err_fp32"], fp32["shared_max_err_fp32"] = _errors_against(reference_rows, rows)
            if base_rows is not None:
                fp32["unshared_rel_err_fp32"], fp32["unshared_max_err_fp32"] = _errors_against(reference_rows, base_rows)
        useful = shared_layout.tokens_unshared
        results.append(
            RowResult(
                model=model_name,
                layers=layers,
                backend=backend,
                P=P, R=R, n=n, groups=args.groups,
                tokens_unshared=shared_layout.tokens_unshared,
                tokens_shared=shared_layout.tokens_shared,
                ideal_speedup=ideal_speedup(P, R, n),
                actor_speedup=base.actor_ms / shared.actor_ms,
                logprob_speedup=base.logprob_ms / shared.logprob_ms,
                actor_peak_ratio=(shared.actor_peak_mib / base.actor_peak_mib) if base.actor_peak_mib else None,
                unshared=base,
                shared=shared,
                unshared_tokens_per_s=useful / (base.actor_ms / 1e3),
                shared_tokens_per_s=useful / (shared.actor_ms / 1e3),
                max_logprob_diff=float((rows - base_rows).abs().max()) if base_rows is not None else math.nan,
                unshared_out_of_memory=base_rows is None,
                **fp32,
            )
        )
    return results


# ---- reporting ------------------------------------------------------------------------------------


def format_table(results: Sequence[RowResult]) -> str:
    head = ("model", "layers", "backend", "P", "R", "n", "tok unsh", "tok sh", "ideal S", "actor x",
            "x/S", "logprob x", "peak unsh GiB", "peak sh GiB", "peak ratio", "tok/s unsh", "tok/s sh",
            "max |dlogp|")
    with_fp32 = any(r.shared_rel_err_fp32 is not None for r in results)
    if with_fp32:
        head += ("rel err sh vs fp32", "rel err unsh vs fp32", "max err sh", "max err unsh")
    lines = []
    for r in results:
        if r.error:
            line = (r.model, str(r.layers), r.backend, str(r.P), str(r.R), str(r.n)) + ("-",) * 11 + (f"ERROR {r.error}",)
            lines.append(line + ("-",) * 4 if with_fp32 else line)
            continue
        missing = "OOM" if r.unshared_out_of_memory else "-"  # what a value that needs the unshared run shows

        def cell(x, spec):
            return missing if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

        lines.append((
            r.model, str(r.layers), r.backend, str(r.P), str(r.R), str(r.n),
            str(r.tokens_unshared), str(r.tokens_shared), f"{r.ideal_speedup:.2f}", cell(r.actor_speedup, ".2f"),
            cell(r.actor_speedup / r.ideal_speedup, ".2f"), cell(r.logprob_speedup, ".2f"),
            cell(r.unshared.actor_peak_mib and r.unshared.actor_peak_mib / 1024, ".2f"),
            cell(r.shared.actor_peak_mib and r.shared.actor_peak_mib / 1024, ".2f"),
            cell(r.actor_peak_ratio, ".2f"), cell(r.unshared_tokens_per_s, ",.0f"),
            cell(r.shared_tokens_per_s, ",.0f"), cell(r.max_logprob_diff, ".2e"),
        ) + (tuple(cell(x, ".2e") for x in (r.shared_rel_err_fp32, r.unshared_rel_err_fp32,
                                            r.shared_max_err_fp32, r.unshared_max_err_fp32))
             if with_fp32 else ()))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [fmt(line) for line in lines]
    return "\n".join(out)


def write_plot(results: Sequence[RowResult], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from None
    ok = [r for r in results if not r.error and not r.unshared_out_of_memory]
    labels = [f"{r.model}\n{r.backend}\nP={r.P} R={r.R} n={r.n}" for r in ok]
    x = range(len(ok))
    width = 0.27
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(ok)), 4.8))
    ax.bar([i - width for i in x], [r.ideal_speedup for r in ok], width, label="ideal S = n(P+R)/(P+nR)", color="#bbbbbb")
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
    import importlib.metadata as md

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


def _error(message: str) -> int:
    print(f"ps-bridge: error: {message}", file=sys.stderr)
    return 2


def run_bench(args: argparse.Namespace) -> int:
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.kernels.attention import BACKENDS

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        return _error(
            "ps-bridge bench measures GPU speed and needs an NVIDIA GPU, but CUDA is not available "
            "here; run 'ps-bridge bench --smoke' for a tiny functional run on the CPU"
        )
    models = args.models or (["tiny-qwen2.5", "tiny-qwen3.5"] if args.smoke else list(DEFAULT_MODELS))
    grid = args.grid or list(SMOKE_GRID if args.smoke else DEFAULT_GRID)
    for name in models:
        if name not in MODEL_SHAPES:
            return _error(f"unknown model shape {name!r}; known: {', '.join(MODEL_SHAPES)}")
        if MODEL_SHAPES[name].family not in FAMILIES:
            return _error(f"model shape {name!r}: family {MODEL_SHAPES[name].family!r} has no builder yet")
    for b in args.backends:
        if b not in BACKENDS:
            return _error(f"unknown attention backend {b!r}; valid backends: {', '.join(sorted(BACKENDS))}")
    if args.layers is not None and args.layers < 1:
        return _error("--layers must be >= 1")
    if args.groups < 1 or args.repeats < 1 or args.warmup < 0:
        return _error("--groups and --repeats must be >= 1, --warmup >= 0")
    warmup, repeats = (min(args.warmup, 1), min(args.repeats, 2)) if args.smoke else (args.warmup, args.repeats)
    args.warmup, args.repeats = warmup, repeats
    dtype = torch.bfloat16 if cuda else torch.float32

    from ps_bridge.runtime import default_device, load_model_from_hf_config

    device = default_device()
    env = environment(device)
    print(f"ps-bridge bench on {env['device']} (torch {env['torch']}, triton {env['triton']}, "
          f"megatron-core {env['megatron_core']}, megatron-bridge {env['megatron_bridge']}), {str(dtype)[6:]}, "
          f"warm-up {warmup}, median of {repeats}", flush=True)

    steps_per_row = 1 + len(args.backends)
    total = len(models) * len(grid) * steps_per_row * (warmup + repeats)
    progress_bar = None
    if not args.no_progress:
        from tqdm import tqdm

        progress_bar = tqdm(total=total, desc="bench", unit="step", file=sys.stderr, dynamic_ncols=True)

    def progress(k):
        if progress_bar is not None:
            progress_bar.update(k)

    results: List[RowResult] = []
    model_info = []
    say = progress_bar.write if progress_bar else lambda text: print(text, flush=True)

    def write_json():  # after every row, so a run cut short still leaves its finished rows
        if args.json is None or args.json == "-":
            return
        payload = dict(environment=env, dtype=str(dtype), warmup=warmup, repeats=repeats, groups=args.groups,
                       models=model_info, rows=[asdict(r) for r in results])
        with open(args.json, "w") as f:
            f.write(json.dumps(payload, indent=2) + "\n")

    for name in models:
        shape = MODEL_SHAPES[name]
        layers = args.layers or shape.bench_layers
        hf_config = FAMILIES[shape.family](shape.dims, layers)
        config = PrefixSharingConfig(enabled=True, backend=args.backends[0], pad_multiple=1)
        loaded = load_model_from_hf_config(hf_config, config, dtype=dtype)
        reference = Fp32Reference(hf_config, loaded, args.logprob_chunk) if args.fp32_reference else None
        head_dim = int(loaded.provider.kv_channels)  # Qwen3.5 sets head_dim apart from hidden/heads
        info = (f"{name}: {layers} of {shape.full_layers} layers, hidden {shape.dims['hidden_size']}, "
                f"heads {shape.dims['num_attention_heads']}/{shape.dims['num_key_value_heads']} kv, head dim "
                f"{head_dim}, vocab {shape.dims['vocab_size']}, random weights")
        model_info.append(info)
        say(info)
        for P, R, n in grid:
            try:
                row = run_row(loaded, name, layers, args.backends, P, R, n, args, progress, reference)
            except Exception as e:  # keep the other rows (an OOM on one shape is a result too)
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                row = [RowResult(name, layers, b, P, R, n, args.groups, 0, 0, ideal_speedup(P, R, n), math.nan,
                                 math.nan, None, ModeResult(0, math.nan, math.nan, None, None),
                                 ModeResult(0, math.nan, math.nan, None, None), math.nan, math.nan, math.nan,
                                 error=msg) for b in args.backends]
                if cuda:
                    torch.cuda.empty_cache()
            results += row
            say(format_table(row).splitlines()[-1] if len(row) == 1 else "\n".join(format_table(row).splitlines()[2:]))
            write_json()
        del loaded, reference
        if cuda:
            torch.cuda.empty_cache()
    if progress_bar is not None:
        progress_bar.close()

    print()
    for info in model_info:
        print(info)
    print(format_table(results))
    for r in results:
        if r.unshared.micro_batches > 1:
            print(f"{r.model} ({r.P}, {r.R}, {r.n}): the unshared batch did not fit in GPU memory at once and ran as "
                  f"{r.unshared.micro_batches} micro-batches (gradient accumulation); the shared one ran as one.")
    if any(r.unshared_out_of_memory for r in results):
        print(f"OOM: the unshared batch did not fit in GPU memory even as {max(UNSHARED_SPLITS)} micro-batches; "
              "the shared one was timed alone.")
    if args.json == "-":
        print(json.dumps(dict(environment=env, dtype=str(dtype), warmup=warmup, repeats=repeats, groups=args.groups,
                              models=model_info, rows=[asdict(r) for r in results]), indent=2))
    write_json()
    if args.plot:
        write_plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if any(r.error for r in results) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry (`python -m ps_bridge.bench`) until the CLI wires `ps-bridge bench`."""
    parser = argparse.ArgumentParser(prog="ps-bridge bench", description=__doc__.split("\n\n")[0])
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
