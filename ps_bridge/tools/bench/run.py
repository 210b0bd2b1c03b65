"""`ps-bridge bench`'s arguments and its run: every model shape, every grid row, the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from functools import partial
from typing import List, Optional, Tuple

import torch
from megatron.core import parallel_state
from tqdm import tqdm

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.forward import cp_total_multiple
from ps_bridge.kernels.attention import BACKENDS
from ps_bridge.layout import build_layout
from ps_bridge.parallel.groups import init_parallel, is_output_rank, launched_world_size, max_over_ranks
from ps_bridge.parallel.settings import ParallelSettings
from ps_bridge.plan import SharingPlan
from ps_bridge.prepare import rule_decision
from ps_bridge.tools.bench.catalog import (
    DEFAULT_GRID,
    DEFAULT_MODELS,
    FAMILIES,
    MIN_SHARED_GRID,
    MIN_SHARED_SMOKE,
    MIN_SHARED_SWEEP,
    MODEL_SHAPES,
    SMOKE_GRID,
    TREE_SHAPES,
    ImagePrompts,
    ideal_speedup,
    is_vision_language,
    make_image_samples,
    make_samples,
    shape_hf_config,
    template_samples,
    vision_depth,
)
from ps_bridge.tools.bench.flops import flop_shape, layout_flop_ratio, model_flops, vision_flops
from ps_bridge.tools.bench.fp32_reference import Fp32Reference, row_errors
from ps_bridge.tools.bench.report import (
    MinSharedRow,
    RowResult,
    environment,
    format_min_shared_table,
    format_table,
    payload,
    write_plot,
)
from ps_bridge.tools.bench.timing import UNSHARED_SPLITS, ModeResult, run_mode, run_pair, run_shared, run_unshared
from ps_bridge.tools.data_parallel import data_parallel_size, dp_share
from ps_bridge.tools.runtime import default_device, load_model_from_hf_config

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


def _parse_runs(text: str) -> List[int]:
    try:
        runs = [int(x) for x in _parse_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--min-shared-sweep {text!r} is not a list of integers 'K,K,...'") from None
    if not runs or min(runs) < 1:
        raise argparse.ArgumentTypeError(f"--min-shared-sweep {text!r}: run lengths must be >= 1")
    return runs


def _parse_image_size(text: str) -> Tuple[int, int]:
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--image-size {text!r} is not 'HxW' (pixels, e.g. 1024x1024)") from None
    if min(h, w) < 1:
        raise argparse.ArgumentTypeError(f"--image-size {text!r}: both sides must be >= 1 pixel")
    return h, w


# image-prompt rows (`--images`) when no --grid is given: 256 text tokens after the image, n = 8, R = 512
IMAGE_GRID: Tuple[Tuple[int, int, int], ...] = ((256, 512, 8),)
IMAGE_SMOKE_GRID: Tuple[Tuple[int, int, int], ...] = ((6, 5, 3),)
DEFAULT_IMAGE_SIZE, SMOKE_IMAGE_SIZE = (1024, 1024), (16, 24)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=_parse_list, default=None,
                        help=f"comma-separated model shapes ({', '.join(MODEL_SHAPES)}); default "
                        f"{','.join(DEFAULT_MODELS)} (tiny-qwen2.5,tiny-qwen3.5 with --smoke)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of every model (default: each shape's bench default, printed)")
    parser.add_argument("--grid", type=_parse_grid, default=None,
                        help="rows 'P,R,n;P,R,n;...' (default: 2048,512,8;4096,256,16;1024,1024,8;512,4096,8)")
    parser.add_argument("--trees", type=_parse_list, default=None,
                        help="comma-separated prefix-tree rows by name (" + "; ".join(
                            f"{k}: {v.description}" for k, v in TREE_SHAPES.items())
                        + "), shared as a token trie; tiny sizes with --smoke. Without --grid only these rows run")
    parser.add_argument("--no-tree", dest="tree", action="store_false", default=None,
                        help="pack the shared runs one level (identical prompts only); default: every common "
                             "prefix as a prefix tree (a grid row's group is a tree of depth one)")
    parser.add_argument("--groups", type=int, default=1, help="prompts (groups of n responses) per micro-batch")
    parser.add_argument("--backends", type=_parse_list, default=["auto"],
                        help="comma-separated attention backends to time prefix-shared (default auto); "
                        "the unshared baseline uses the first")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps; the median is reported (default 5)")
    parser.add_argument("--logprob-chunk", type=int, default=1024,
                        help="rows per float32 log-softmax chunk (default 1024; 0.6 GB at a 152k vocabulary)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="run the actor steps and log-prob passes as CUDA graphs (PrefixSharingConfig.cuda_graphs), "
                             "shared and unshared alike: each packing is captured in the warm-up and replayed when timed")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="also write the results as JSON to FILE (stdout when FILE is omitted)")
    parser.add_argument("--plot", default=None, metavar="FILE", help="write a PNG of measured vs ideal speed-up")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and grid, few repeats; runs on a CPU (for CI)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel size: run under 'torchrun --nproc-per-node N' with N = --cp "
                             "(global rank 0 reports); every micro-batch is split into N contiguous shards")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size (MoE shapes): run under 'torchrun --nproc-per-node N' with N = --ep "
                             "(global rank 0 reports); the ranks are data-parallel: each gets its own whole groups of "
                             "the row's batch (--groups a multiple of N), gradients are reduced over them every step")
    parser.add_argument("--shared-only", action="store_true",
                        help="time the prefix-shared packing alone (no unshared baseline): how long a P fits")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=None,
                        help="report a micro-batch with more packed tokens per GPU as out of memory without running "
                             "it (under NCCL a rank out of memory in a collective hangs its peer; every rank "
                             "decides alike); the unshared batch is then split further")
    parser.add_argument("--stop-on-failure", action="store_true",
                        help="stop after the first row that fails (a grid of growing P: the next ones fail too)")
    parser.add_argument("--collective-timeout", type=float, default=None, metavar="SECONDS",
                        help="under --cp: abort a collective that waits longer (a peer ran out of memory)")
    parser.add_argument("--min-shared-sweep", type=_parse_runs, nargs="?", const=[], default=None, metavar="K,K,...",
                        help="measure the tree's threshold (layout.DEFAULT_MIN_SHARED): for each grid row (P, R, n) "
                             "and each run length K (default " + ",".join(map(str, MIN_SHARED_SWEEP)) + "), --groups "
                             "prompts of P tokens that share only their first K tokens, n responses of R each, packed "
                             "as a token trie at min_shared=0 (the run shared: one more tree level) and at "
                             "min_shared=K+1 (the run in every prompt), timed interleaved; x = the second's time over "
                             "the first's (> 1: sharing a run of K pays). Needs --groups >= 2 and P > 2K; only these "
                             "rows run (default grid " + ";".join(",".join(map(str, r)) for r in MIN_SHARED_GRID) + ")")
    parser.add_argument("--images", type=int, default=0, metavar="K",
                        help="image prompts (vision-language shapes: " + ", ".join(
                            k for k, v in MODEL_SHAPES.items() if is_vision_language(v)) + "): every prompt carries K "
                        "random images of its own before its P text tokens; the shared run computes the vision tower "
                        "once per distinct image, the unshared run once per sample, and F counts the tower (default "
                        "grid " + ";".join(",".join(map(str, r)) for r in IMAGE_GRID) + ")")
    parser.add_argument("--image-size", type=_parse_image_size, default=None, metavar="HxW",
                        help="pixels of each --images image (default %dx%d: %d merged vision tokens at patch 16, merge 2; "
                             "%dx%d with --smoke)" % (*DEFAULT_IMAGE_SIZE, (DEFAULT_IMAGE_SIZE[0] // 32) *
                                                      (DEFAULT_IMAGE_SIZE[1] // 32), *SMOKE_IMAGE_SIZE))
    parser.add_argument("--vision-layers", type=int, default=None,
                        help="vision tower layers of vision-language shapes (default: the tower's depth cut in the "
                             "text layers' proportion, printed)")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="also compare both bf16 runs with a float32 reference on the same weights (unshared "
                             "packing, torch_ref kernels, TF32 off): relative error of the response log-probs")


# ---- one grid row ------------------------------------------------------------------------------


def _data_parallel_share(samples: list) -> list:
    """This data-parallel rank's whole groups of the row's batch (all of it without EP)."""
    return dp_share(samples)[1]


def _whole_batch_rows(rows):
    """Every data-parallel rank's response rows, in rank order, on every rank (as given without EP)."""
    if rows is None or data_parallel_size() == 1:
        return rows
    group = parallel_state.get_data_parallel_group()
    box = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(box, rows.cpu(), group=group)
    return torch.cat(box)


def _slowest_rank(mode: ModeResult) -> ModeResult:
    """Under EP the step is the slowest data-parallel rank's (they wait for each other in the expert
    exchange and the gradient reduction): the largest median time and peak over the ranks."""
    if data_parallel_size() == 1:
        return mode
    peak = lambda mib: None if mib is None else max_over_ranks(mib)  # noqa: E731
    return dataclasses.replace(
        mode, actor_ms=max_over_ranks(mode.actor_ms), logprob_ms=max_over_ranks(mode.logprob_ms),
        actor_peak_mib=peak(mode.actor_peak_mib), logprob_peak_mib=peak(mode.logprob_peak_mib),
    )


def world_layout(args) -> dict:
    """How the processes of this run are laid out (stated with every row)."""
    dp = data_parallel_size()
    return dict(world_size=launched_world_size(), cp=args.cp, ep=args.ep, data_parallel=dp,
                groups_per_rank=args.groups // dp)


def image_prompts(args) -> Optional[ImagePrompts]:
    """`--images` / `--image-size` as `ImagePrompts`, or None (text prompts)."""
    if not args.images:
        return None
    h, w = args.image_size or (SMOKE_IMAGE_SIZE if args.smoke else DEFAULT_IMAGE_SIZE)
    return ImagePrompts(args.images, h, w)


def row_batch(P: int, R: int, n: int, tree: Optional[str], args, vocab: int, model_name: Optional[str] = None):
    """A row's micro-batch: `groups` prompts of P tokens with n responses of R (with `--images`, each
    prompt's own images before them), or the named tree shape (`catalog.TREE_SHAPES`, tiny under --smoke)."""
    images = image_prompts(args)
    if images is not None and tree is None:
        return make_image_samples(P, R, n, args.groups, MODEL_SHAPES[model_name].dims, images, args.seed)
    if tree is None:
        return make_samples(P, R, n, args.groups, vocab, args.seed)
    return TREE_SHAPES[tree].samples(vocab, args.seed, smoke=args.smoke)


def run_row(loaded, model_name, layers, backends, P, R, n, args, progress, reference=None,
            tree: Optional[str] = None) -> List[RowResult]:
    """One row: a grid row (P, R, n) or, with `tree`, a named tree shape (P = R = n = 0)."""
    batch = row_batch(P, R, n, tree, args, loaded.vocab_size, model_name)
    share = loaded.config.layout_share(True)  # a token trie at the default threshold, or one level (--no-tree)
    samples = _data_parallel_share(batch)  # under EP this rank's whole groups; the row counts the whole batch
    pack = partial(build_layout, share=share, vocab_size=loaded.vocab_size, total_multiple=cp_total_multiple(),
                   prompt_values=loaded.config.layout_prompt_values)
    shared_layout = pack(samples)
    whole = shared_layout if len(samples) == len(batch) else pack(batch)  # the whole batch's token counts
    # F: the unshared computation's model FLOPs over those of the shared one that is timed
    shape = flop_shape(MODEL_SHAPES[model_name], layers, getattr(args, "vision_layers", None))
    unshared_whole = build_layout(batch, share=False, vocab_size=loaded.vocab_size)
    flops = layout_flop_ratio(shape, whole, unshared_whole)
    images = image_row(shape, whole, unshared_whole, args, MODEL_SHAPES[model_name], P) if tree is None else None
    common = dict(warmup=args.warmup, repeats=args.repeats, chunk=args.logprob_chunk, progress=progress,
                  max_tokens=args.max_tokens_per_gpu)
    if args.shared_only:
        base, base_rows, layouts = None, None, []
    else:
        base, base_rows, layouts = run_unshared(loaded, samples, backends[0], **common)
    if base is None:  # not even split: time the shared packing alone
        base = ModeResult(shared_layout.tokens_unshared, math.nan, math.nan, None, None, micro_batches=0)
    base, base_rows = _slowest_rank(base), _whole_batch_rows(base_rows)
    reference_rows = None
    if reference is not None and base_rows is not None:  # on the same micro-batches as the unshared run
        reference_rows = _whole_batch_rows(reference.response_logprobs(layouts))
    results = []
    for backend in backends:
        # one micro-batch, or split where it does not fit (each part then computes its prefixes: F counts that)
        shared, rows, shared_layouts = run_shared(loaded, samples, shared_layout, pack, backend, **common)
        if len(shared_layouts) > 1 and len(samples) == len(batch):
            flops = layout_flop_ratio(shape, shared_layouts, unshared_whole)
        shared, rows = _slowest_rank(shared), _whole_batch_rows(rows)
        fp32 = row_errors(reference_rows, rows, base_rows)
        useful = whole.tokens_unshared
        results.append(
            RowResult(
                model=model_name,
                layers=layers,
                backend=backend,
                P=P, R=R, n=n, groups=args.groups,
                tokens_unshared=whole.tokens_unshared,
                tokens_shared=whole.tokens_shared,
                ideal_speedup=(ideal_speedup(P, R, n) if tree is None and images is None
                               else whole.tokens_unshared / whole.tokens_shared),
                actor_speedup=base.actor_ms / shared.actor_ms,
                logprob_speedup=base.logprob_ms / shared.logprob_ms,
                actor_peak_ratio=(shared.actor_peak_mib / base.actor_peak_mib) if base.actor_peak_mib else None,
                unshared=base,
                shared=shared,
                unshared_tokens_per_s=useful / (base.actor_ms / 1e3),
                shared_tokens_per_s=useful / (shared.actor_ms / 1e3),
                max_logprob_diff=float((rows - base_rows).abs().max()) if base_rows is not None else math.nan,
                unshared_out_of_memory=base_rows is None and not args.shared_only,
                parallel=world_layout(args),
                tree=tree,
                tree_depth=whole.tree_depth,
                nodes=whole.num_segments,
                flop_ratio=flops,
                share="tree" if share == "tree" else "prompt",
                images=images,
                rule=rule_decisions(loaded, samples, backend),
                **fp32,
            )
        )
    return results


def rule_decisions(loaded, samples, backend: str) -> dict:
    """What the sharing rule decides for this rank's micro-batch of the row (`prepare.rule_decision`,
    `PS_BRIDGE_SHARING=auto`, without CUDA graphs) with the backward (`actor`) and without it
    (`logprob`); a row too large for one micro-batch is decided whole. The bench times both packings
    whatever the rule decides, so a row shows whether the rule picks the faster one on this machine (its
    host costs were measured on one machine: `launch_rule.HOST_NS`)."""
    config = dataclasses.replace(loaded.config, sharing="auto", backend=backend, cuda_graphs=False)
    # the prefix tree the rule counts, decided once for both passes (as the verl engine's plan does)
    tree = SharingPlan.from_config(config).for_samples(samples, vocab_size=loaded.vocab_size).tree if config.tree else None
    out = {}
    for what, backward in (("actor", True), ("logprob", False)):
        decision = rule_decision(samples, config, loaded.model_cost, loaded.device.type, loaded.dtype, tree=tree,
                                 backward=backward, log=False)
        out[what] = ("shared" if decision.share else "unshared") if decision.priced else "not applied"
        out[f"{what}_reason"] = decision.reason
    return out


def image_row(shape, shared, unshared, args, model, P: int) -> Optional[dict]:
    """An image row's `images` field: the prompts' images, the tower's runs and its FLOPs in each
    packing (`flops.vision_flops`: part of F's counts), or None for a text row."""
    prompts = image_prompts(args)
    if prompts is None:
        return None
    vision = model.dims["vision"]
    return dict(
        per_prompt=prompts.per_prompt, size=[prompts.height, prompts.width], grid_thw=list(prompts.grid(vision)),
        tokens_per_image=prompts.tokens_per_image(vision), text_tokens=P,
        prompt_tokens=prompts.prompt_tokens(P, vision), vision_layers=shape.vision.depth,
        tower_images_shared=shared.images.num_images, tower_images_unshared=unshared.images.num_images,
        vision_flops_shared=vision_flops(shape, shared), vision_flops_unshared=vision_flops(shape, unshared),
        model_flops_shared=model_flops(shape, shared), model_flops_unshared=model_flops(shape, unshared),
    )


def run_min_shared_row(loaded, model_name, layers, backends, P, R, n, run, args, progress) -> List[MinSharedRow]:
    """One `--min-shared-sweep` row: the template micro-batch (`catalog.template_samples`: --groups
    prompts of P sharing their first `run` tokens) packed as a token trie at `min_shared=0` and at
    `min_shared=run + 1`, timed against each other (`timing.run_pair`) with each backend."""
    samples = template_samples(loaded.vocab_size, args.seed, args.groups, P, run, n, R)
    pack = partial(build_layout, samples, share="tree", vocab_size=loaded.vocab_size,
                   total_multiple=cp_total_multiple(), prompt_values=loaded.config.layout_prompt_values)
    shared, unshared = pack(min_shared=0), pack(min_shared=run + 1)
    results = []
    for backend in backends:
        a, a_rows, b, b_rows = run_pair(loaded, shared, unshared, backend, args.warmup, args.repeats,
                                        args.logprob_chunk, progress)
        results.append(MinSharedRow(
            model=model_name, layers=layers, backend=backend, P=P, R=R, n=n, groups=args.groups, run=run,
            tokens_shared_run=shared.tokens_shared, tokens_unshared_run=unshared.tokens_shared,
            depth_shared_run=shared.tree_depth, depth_unshared_run=unshared.tree_depth,
            nodes_shared_run=shared.num_segments, nodes_unshared_run=unshared.num_segments,
            shared_run=a, unshared_run=b, actor_x=b.actor_ms / a.actor_ms, logprob_x=b.logprob_ms / a.logprob_ms,
            max_logprob_diff=float((a_rows - b_rows).abs().max()),
        ))
    return results


# ---- entry point ------------------------------------------------------------------------------------


def _failure(e: Exception) -> str:
    """A failed row's error cell: the exception's type and first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:320] if str(e) else ''}"


def _min_shared_row(loaded, name, layers, P, R, n, k, args, progress, say) -> List[MinSharedRow]:
    """`run_min_shared_row`, a failure kept as a row (the other rows still run), said as it ends."""
    try:
        rows = run_min_shared_row(loaded, name, layers, args.backends, P, R, n, k, args, progress)
    except Exception as e:  # an OOM on one shape is a result too
        rows = [MinSharedRow.failed(name, layers, b, P, R, n, args.groups, k, _failure(e)) for b in args.backends]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    say("\n".join(format_min_shared_table(rows).splitlines()[2:]))
    return rows


def _tree_option(args) -> dict:
    """`PrefixSharingConfig`'s tree setting from --no-tree; unset: the config's default."""
    return {} if args.tree is None else {"tree": args.tree}


def _error(message: str) -> int:
    print(f"ps-bridge: error: {message}", file=sys.stderr)
    return 2


def _expert_parallel_problem(args, models, world_size: int):
    """What keeps this bench run from `--ep`, or None. The bench's own limits: every data-parallel
    rank must get the same number of whole groups (so every rank makes the same decisions and
    collectives), MoE shapes only, not together with --cp."""
    dense = [m for m in models if not MODEL_SHAPES[m].family.endswith("-moe")]
    if dense:
        moe = ", ".join(k for k, v in MODEL_SHAPES.items() if v.family.endswith("-moe"))
        return f"--ep {args.ep} needs MoE model shapes; {', '.join(dense)} has no experts (use --models {moe})"
    if args.cp > 1:
        return f"the bench runs --ep or --cp, not both (--ep {args.ep} --cp {args.cp}): drop one"
    dp = world_size // args.cp
    if args.groups % dp:
        return (f"--groups {args.groups} cannot be split evenly across the {dp} data-parallel ranks of --ep {args.ep} "
                f"(each rank gets whole groups, the same number): use --groups {dp * max(1, args.groups // dp)}")
    return None


def _min_shared_sweep_problem(args, grid) -> Optional[str]:
    """What keeps this run from `--min-shared-sweep`, or None."""
    others = [flag for flag, on in (("--trees", args.trees), ("--cp", args.cp > 1), ("--ep", args.ep > 1),
                                    ("--shared-only", args.shared_only), ("--fp32-reference", args.fp32_reference),
                                    ("--plot", args.plot)) if on]
    if others:
        return f"--min-shared-sweep runs its own rows on one device: drop {', '.join(others)}"
    if args.groups < 2:
        return (f"--min-shared-sweep needs prompts that share the run: --groups {args.groups} gives one prompt; "
                "use e.g. --groups 8")
    for P, _, _ in grid:
        too_long = [k for k in args.min_shared_sweep if P <= 2 * k]
        if too_long:
            return (f"--min-shared-sweep run {too_long[0]} needs prompts of more than {2 * too_long[0]} tokens (grid "
                    f"row P={P}): at min_shared={too_long[0] + 1} a prompt's own {P - too_long[0]} tokens must still "
                    "be shared by its responses; use a longer P or shorter runs")
    return None


def _image_problem(args, models: Optional[List[str]]) -> Optional[str]:
    """What keeps this run from `--images`, or None."""
    if args.images < 0:
        return "--images must be >= 0"
    others = [flag for flag, on in (("--trees", args.trees), ("--min-shared-sweep", args.min_shared_sweep is not None),
                                    ("--cp", args.cp > 1), ("--ep", args.ep > 1)) if on]
    if others:
        return f"--images runs grid rows on one device: drop {', '.join(others)}"
    text = [m for m in models or [] if m in MODEL_SHAPES and not is_vision_language(MODEL_SHAPES[m])]
    if text:
        vl = ", ".join(k for k, v in MODEL_SHAPES.items() if is_vision_language(v))
        return f"--images needs vision-language model shapes; {', '.join(text)} has no vision tower (use --models {vl})"
    return None


def run_bench(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        return _error(
            "ps-bridge bench measures GPU speed and needs an NVIDIA GPU, but CUDA is not available "
            "here; run 'ps-bridge bench --smoke' for a tiny functional run on the CPU"
        )
    models = args.models or (
        (["tiny-qwen3.5-moe"] if args.ep > 1 else ["tiny-qwen2.5", "tiny-qwen3.5"]) if args.smoke else list(DEFAULT_MODELS)
    )
    trees = args.trees or []
    grid = args.grid or ([] if trees else list(SMOKE_GRID if args.smoke else DEFAULT_GRID))
    if args.images:
        problem = _image_problem(args, models if args.models else None)
        if problem:
            return _error(problem)
        models = args.models or ["tiny-qwen3.5-vl" if args.smoke else "qwen3.5-9b-vl"]
        grid = args.grid or list(IMAGE_SMOKE_GRID if args.smoke else IMAGE_GRID)
    if args.min_shared_sweep is not None:
        smoke_grid, smoke_runs = MIN_SHARED_SMOKE
        grid = args.grid or list(smoke_grid if args.smoke else MIN_SHARED_GRID)
        args.min_shared_sweep = args.min_shared_sweep or list(smoke_runs if args.smoke else MIN_SHARED_SWEEP)
        problem = _min_shared_sweep_problem(args, grid)
        if problem:
            return _error(problem)
    for name in trees:
        if name not in TREE_SHAPES:
            return _error(f"unknown tree shape {name!r} (--trees); known: {', '.join(TREE_SHAPES)}")
    if trees and (args.cp > 1 or args.ep > 1):
        return _error("--trees runs on one GPU (parallel layouts refuse prefix trees deeper than one level): "
                      "drop --cp/--ep or --trees")
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
    if args.vision_layers is not None and args.vision_layers < 1:
        return _error("--vision-layers must be >= 1")
    if args.images:
        try:
            for name in models:
                image_prompts(args).grid(MODEL_SHAPES[name].dims["vision"])
        except ValueError as e:
            return _error(str(e))
    if args.groups < 1 or args.repeats < 1 or args.warmup < 0:
        return _error("--groups and --repeats must be >= 1, --warmup >= 0")
    if (args.cp > 1 or args.ep > 1) and not cuda and not args.smoke:
        return _error("--cp and --ep need GPUs (or --smoke on a CPU)")

    try:
        # torchrun's world must be --cp (--ep) processes or a multiple
        ParallelSettings(cp=args.cp, ep=args.ep).check()
    except ValueError as e:
        return _error(str(e))
    if args.ep > 1:
        problem = _expert_parallel_problem(args, models, launched_world_size())
        if problem:
            return _error(problem)
    if args.cp > 1 or args.ep > 1:
        # before any model: the process groups, with the collective timeout
        init_parallel(cp=args.cp, ep=args.ep, timeout_s=args.collective_timeout)
    report = is_output_rank()
    warmup, repeats = (min(args.warmup, 1), min(args.repeats, 2)) if args.smoke else (args.warmup, args.repeats)
    args.warmup, args.repeats = warmup, repeats
    dtype = torch.bfloat16 if cuda else torch.float32

    device = default_device()
    env = environment(device)
    out = print if report else (lambda *a, **k: None)
    dp = launched_world_size() // args.cp
    out(f"ps-bridge bench on {env['device']} (torch {env['torch']}, triton {env['triton']}, "
          f"megatron-core {env['megatron_core']}, megatron-bridge {env['megatron_bridge']}), {str(dtype)[6:]}, "
          f"warm-up {warmup}, median of {repeats}, shared "
          + ("as prefix trees" if PrefixSharingConfig(**_tree_option(args)).tree else "one level (--no-tree)")
          + (f", context parallel {args.cp} GPUs" if args.cp > 1 else "")
        + (f", expert parallel {args.ep} (data parallel {dp}: each rank {args.groups // dp} of the "
           f"{args.groups} groups, gradients reduced every step)" if args.ep > 1 else ""),
        flush=True)

    steps_per_row = 1 + len(args.backends)
    total = len(models) * (len(grid) + len(trees)) * steps_per_row * (warmup + repeats)
    if args.min_shared_sweep:
        total = len(models) * len(grid) * len(args.min_shared_sweep) * 2 * len(args.backends) * (warmup + repeats)
    progress_bar = None
    if not args.no_progress and report:
        progress_bar = tqdm(total=total, desc="bench", unit="step", file=sys.stderr, dynamic_ncols=True)

    def progress(k):
        if progress_bar is not None:
            progress_bar.update(k)

    results: List[RowResult] = []
    sweep: Optional[List[MinSharedRow]] = [] if args.min_shared_sweep else None
    model_info = []
    say = progress_bar.write if progress_bar else lambda text: out(text, flush=True)

    def document():
        return payload(env, dtype, warmup, repeats, args.groups, model_info, results, sweep, args.cuda_graphs)

    def write_json():  # after every row, so a run cut short still leaves its finished rows
        if args.json is None or args.json == "-" or not report:
            return
        with open(args.json, "w") as f:
            f.write(json.dumps(document(), indent=2) + "\n")

    for name in models:
        shape = MODEL_SHAPES[name]
        layers = args.layers or shape.bench_layers
        hf_config = shape_hf_config(shape, layers, args.vision_layers)
        config = PrefixSharingConfig(enabled=True, backend=args.backends[0], pad_multiple=1,
                                     cuda_graphs=args.cuda_graphs, **_tree_option(args))
        loaded = load_model_from_hf_config(hf_config, config, dtype=dtype, cp=args.cp, ep=args.ep)
        reference = Fp32Reference(hf_config, loaded, args.logprob_chunk) if args.fp32_reference else None
        head_dim = int(loaded.provider.kv_channels)  # Qwen3.5 sets head_dim apart from hidden/heads
        info = (f"{name}: {layers} of {shape.full_layers} layers, hidden {shape.dims['hidden_size']}, "
                f"heads {shape.dims['num_attention_heads']}/{shape.dims['num_key_value_heads']} kv, head dim "
                f"{head_dim}, vocab {shape.dims['vocab_size']}, random weights")
        if is_vision_language(shape):
            v = shape.dims["vision"]
            info += (f"; vision tower {vision_depth(shape, layers, args.vision_layers)} of {v['depth']} layers, hidden "
                     f"{v['hidden_size']}, patch {v['patch_size']}, merge {v['spatial_merge_size']}")
            if args.images:
                p = image_prompts(args)
                info += (f"; each prompt {p.per_prompt} image(s) of {p.height}x{p.width} pixels = "
                         f"{p.tokens_per_image(v)} vision tokens, before P text tokens")
        model_info.append(info)
        say(info)
        if sweep is not None:
            for P, R, n in grid:
                for k in args.min_shared_sweep:
                    sweep += _min_shared_row(loaded, name, layers, P, R, n, k, args, progress, say)
                    write_json()
        else:
            for P, R, n, tree in [(P, R, n, None) for P, R, n in grid] + [(0, 0, 0, t) for t in trees]:
                label = tree or f"({P}, {R}, {n})"
                try:
                    row = run_row(loaded, name, layers, args.backends, P, R, n, args, progress, reference, tree=tree)
                except Exception as e:  # keep the other rows (an OOM on one shape is a result too)
                    row = [RowResult.failed(name, layers, b, P, R, n, args.groups, _failure(e), tree=tree)
                           for b in args.backends]
                    if cuda:
                        torch.cuda.empty_cache()
                results += row
                say(format_table(row).splitlines()[-1] if len(row) == 1 else "\n".join(format_table(row).splitlines()[2:]))
                write_json()
                if args.stop_on_failure and any(r.error for r in row):
                    say(f"stopping after the failed row {label} (--stop-on-failure)")
                    break
        del loaded, reference
        if cuda:
            torch.cuda.empty_cache()
    if progress_bar is not None:
        progress_bar.close()

    if not report:
        return 1 if any(r.error for r in results) else 0
    print()
    for info in model_info:
        print(info)
    if sweep is not None:
        print(format_min_shared_table(sweep))
        print("x: time with the run in every prompt (min_shared = K + 1) over time with it shared (min_shared = 0); "
              "> 1: sharing a common run of K tokens pays")
        if args.json == "-":
            print(json.dumps(document(), indent=2))
        write_json()
        return 1 if any(r.error for r in sweep) else 0
    print(format_table(results))
    for r in results:
        if r.unshared.micro_batches > 1 or r.shared.micro_batches > 1:
            print(f"{r.model} {r.tree or (r.P, r.R, r.n)}: the batch did not fit in GPU memory at once; it ran as "
                  f"{r.unshared.micro_batches} unshared and {r.shared.micro_batches} shared micro-batches (gradient "
                  "accumulation; the shared ones compute each prefix they hold, F counts that).")
    if any(r.unshared_out_of_memory for r in results):
        print(f"OOM: the unshared batch did not fit in GPU memory even as {max(UNSHARED_SPLITS)} micro-batches; "
              "the shared one was timed alone.")
    if args.json == "-":
        print(json.dumps(document(), indent=2))
    write_json()
    if args.plot:
        write_plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if any(r.error for r in results) else 0
