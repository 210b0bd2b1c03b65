"""Profile one `ps-bridge bench` row on the GPU: where does the time of each packing go, host or GPU?

    python3 tools/profile_bench_row.py --models qwen3.5-0.8b,qwen2.5-0.5b --layers 24 --row 128,32,8 --groups 4 --out DIR
    python3 tools/profile_bench_row.py --models qwen3.5-9b --layers 4 --tree chain --unshared-splits 8 --out DIR

(`--cuda-graphs`: each pass captured in the warm-up and replayed when measured; `--tree NAME`: a prefix-tree
row of `ps-bridge bench --trees` (`catalog.TREE_SHAPES`) instead of a grid row, shared as a token trie.)

Builds each model shape as the bench does (random weights, bf16), packs the row's micro-batch
unshared and shared, warms up, and for the actor step (forward, log-probs, loss, backward) and the
log-prob pass (forward only, no_grad) of each packing measures:
- wall: the step's time with the GPU work finished (median of 5, no profiler);
- host: the time until the step's Python returns, before waiting for the GPU (median of 5): when it
  is close to wall, the step is bound by host time (Python, launches, syncs), not by the GPU;
- GPU busy: the sum of the durations of its GPU kernels and copies (one profiled step);
- launches (CUDA and Triton kernel launches), syncs (stream/device/event synchronizations, which
  blocking device-to-host reads such as `.item()` and `.tolist()` include), host-to-device copies
  (one profiled step).
Per layer = the figure over the decoder layers. One line per (model, packing, pass) to stdout and
DIR/profile-summary.md; per packing the top host ops (by self CPU time) and GPU kernels to
DIR/profile_<model>_<packing>_<pass>.txt, and every GPU kernel's and copy's time to
DIR/kernels_<model>_<packing>_<pass>.tsv.

The table of GPU time by kind of work gives each kind the ratio it can at most reach (its FLOP ratio
where the FLOP count has the kind, the token ratio S for memory-bound work) and the shared step with
every kind at that ratio: the ceiling of the speed-up with these kernels, next to F. A kind whose
shared time exceeds its unshared time over its ratio does work that sharing could remove; the gap
between the ceiling and F is the kernel mix (memory-bound work gains S, not F). A last line removes the
kinds held to S from both packings: the speed-up no fusion of memory-bound work can pass, with the
kinds of the FLOP count as measured and at their ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
# the CUDA runtime's waits only: a read of a CUDA tensor's value (`.item()`, `.tolist()`) waits in
# cudaStreamSynchronize, while `aten::_local_scalar_dense` also reads CPU scalars without waiting (the
# 0-d CPU tensors torch.compile passes a compiled function's float arguments as, read once per call)
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
H2D = ("cudaMemcpyAsync", "cudaMemcpy")


# GPU kernels by kind of work, first match wins (torch's, cuBLAS's, CUTLASS's, fla's and our kernels' names)
KINDS = (
    ("grouped GEMM (MoE experts)", ("GroupProblemShape",)),
    ("attention (flash, cuDNN, merge)", ("flash", "cudnn", "merge_kernel")),
    ("dense GEMM (projections, output layer)", ("nvjet", "gemm", "Gemm", "cutlass")),
    ("vocabulary softmax", ("row_max_sumexp", "minus_weighted_softmax")),
    ("Gated DeltaNet and its conv (fla)", ("chunk", "wy_repr", "recompute_w_u", "kernel_h", "dhu", "causal_conv1d",
                                           "kernel_kernel", "l2norm", "cumsum", "solve_tril", "merge_16x16")),
    ("gather, scatter, sort, top-k", ("gather", "scatter", "index", "Index", "sort", "Sort", "topk", "TopK")),
    ("fused element-wise (Triton: our norms and gates, torch.compile's)", ("row_norm_", "gates_fwd", "gates_bwd", "triton_")),
    ("copies and fills", ("Memcpy", "Memset", "copy", "Fill", "Cat")),
)


def kind_of(kernel: str) -> str:
    for kind, marks in KINDS:
        if any(mark in kernel for mark in marks):
            return kind
    return "other elementwise and reductions"


# the profiler's kinds of work whose FLOPs the count (`ps_bridge/tools/bench/flops.py`) has, by its kind
FLOP_KIND_OF = {
    "dense GEMM (projections, output layer)": "dense",
    "grouped GEMM (MoE experts)": "experts",
    "attention (flash, cuDNN, merge)": "attention",
    "Gated DeltaNet and its conv (fla)": "gdn",
}
SOFTMAX = "vocabulary softmax"


def expected_ratios(flops: dict, outputs: dict) -> dict:
    """What each kind of work can at most gain, unshared over shared: its FLOP ratio where the count
    has it (`FLOP_KIND_OF`; `flops[side][kind]`), the ratio of output-layer positions for the
    vocabulary softmax (`outputs[side]`), sides "shared" and "unshared". The rest (memory-bound work:
    element-wise ops, norms, copies, the permutation's gathers) gains at most the ratio of packed tokens
    S, which `kinds_table` gives every kind not listed here."""
    ratios = {kind: flops["unshared"][k] / flops["shared"][k]
              for kind, k in FLOP_KIND_OF.items() if flops["shared"].get(k)}
    ratios[SOFTMAX] = outputs["unshared"] / outputs["shared"]
    return ratios


def kinds_table(shared: dict, unshared: dict, token_ratio: float, ratios: Optional[dict] = None,
                flop_ratio: Optional[float] = None) -> str:
    """Markdown: GPU ms per kind of work of the shared and the unshared packing ({kernel: (calls, us)}),
    their ratio, the ratio the kind can at most reach (`ratios`, from `expected_ratios`; S where it has
    none), and the shared time above the unshared time over that ratio: the work each kind does beyond
    what sharing leaves of it. Then the step with every kind at its ratio: the ceiling of the speed-up
    with these kernels, also over F (`flop_ratio`) where given."""
    ratios = ratios or {}
    totals = {}
    for side, kernels in (("shared", shared), ("unshared", unshared)):
        for kernel, (_, us) in kernels.items():
            totals.setdefault(kind_of(kernel), {"shared": 0.0, "unshared": 0.0})[side] += us / 1e3
    if not all(sum(t[side] for t in totals.values()) for side in ("shared", "unshared")):
        return "no GPU kernels recorded"
    lines = ["| kind of work | shared ms | unshared ms | unshared / shared | at most "
             "| shared ms above unshared / at most |",
             "|---|---|---|---|---|---|"]
    ideal = 0.0
    for kind, t in sorted(totals.items(), key=lambda item: -item[1]["shared"]):
        bound = ratios.get(kind, token_ratio)
        ideal += t["unshared"] / bound
        ratio = f"{t['unshared'] / t['shared']:.2f}" if t["shared"] else "-"
        lines.append(f"| {kind} | {t['shared']:.1f} | {t['unshared']:.1f} | {ratio} | {bound:.2f} | "
                     f"{t['shared'] - t['unshared'] / bound:.1f} |")
    all_s = sum(t["shared"] for t in totals.values())
    all_u = sum(t["unshared"] for t in totals.values())
    lines.append(f"| all | {all_s:.1f} | {all_u:.1f} | {all_u / all_s:.2f} | {all_u / ideal:.2f} | "
                 f"{all_s - ideal:.1f} |")
    over_f = (lambda x: f" = {x / flop_ratio:.2f} F") if flop_ratio else (lambda x: "")
    ceiling = f"every kind at its ratio: {ideal:.1f} ms shared, {all_u / ideal:.2f}x{over_f(all_u / ideal)}"
    if flop_ratio:
        ceiling += f" (measured {all_u / all_s / flop_ratio:.2f} F, F = {flop_ratio:.2f})"
    # What no fusion of memory-bound work can pass: the step with the kinds held to S gone from both
    # packings (as if they took no time), the kinds of the FLOP count as measured and at their ratios
    counted = {kind: t for kind, t in totals.items() if kind in ratios}
    if counted and len(counted) < len(totals):
        c_s = sum(t["shared"] for t in counted.values())
        c_u = sum(t["unshared"] for t in counted.values())
        c_ideal = sum(t["unshared"] / ratios[kind] for kind, t in counted.items())
        if c_s:
            ceiling += (f"\nwithout the kinds held to S on either side: {c_s:.1f} ms shared, {c_u / c_s:.2f}x"
                        f"{over_f(c_u / c_s)}; each kind at its ratio: {c_u / c_ideal:.2f}x{over_f(c_u / c_ideal)}")
    return "\n".join(lines) + f"\n\n{ceiling}"


def _time(fn, repeats: int = 5):
    """(wall ms, host ms): medians over `repeats`."""
    wall, host = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return statistics.median(wall), statistics.median(host)


def _profiled(fn, shapes: bool = False):
    """(GPU busy ms, launches, syncs, copies, key averages, {kernel name: (calls, GPU us)}) of one step."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            calls, us = kernels.get(e.name, (0, 0.0))
            kernels[e.name] = (calls + 1, us + e.time_range.elapsed_us())
    gpu_us = sum(us for _, us in kernels.values())
    averages = prof.key_averages()
    count = {e.key: e.count for e in averages}
    launches = sum(count.get(k, 0) for k in LAUNCH)
    # the step's own final synchronize is not the step's
    syncs = sum(count.get(k, 0) for k in SYNC) - 1
    copies = sum(count.get(k, 0) for k in H2D)
    by_shape = prof.key_averages(group_by_input_shape=True) if shapes else None
    return gpu_us / 1e3, launches, syncs, copies, averages, kernels, by_shape


def profile_model(name: str, layers_arg, row, groups: int, backend: str, out: str, lines: list,
                  kind_tables: list, cuda_graphs: bool = False, unshared_splits: int = 1,
                  shapes: bool = False, tree: Optional[str] = None) -> None:
    from ps_bridge.tools.bench.catalog import FAMILIES, MODEL_SHAPES, TREE_SHAPES, make_samples, response_row_mask
    from ps_bridge.tools.bench.flops import FLOP_KINDS, flop_shape, flops_by_kind, output_positions
    from ps_bridge.tools.bench.timing import run_actor_step, split_in_order
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.layout import build_layout
    from ps_bridge.tools.runtime import load_model_from_hf_config, row_logprobs

    P, R, n = row
    shape = MODEL_SHAPES[name]
    layers = layers_arg or shape.bench_layers
    config = PrefixSharingConfig(enabled=True, backend=backend, pad_multiple=1, cuda_graphs=cuda_graphs)
    loaded = load_model_from_hf_config(FAMILIES[shape.family](shape.dims, layers), config, dtype=torch.bfloat16)
    counted = flop_shape(shape, layers)  # the FLOP count's view of the model
    if tree is None:
        samples, label, shared = make_samples(P, R, n, groups, loaded.vocab_size, 1234), f"({P}, {R}, {n}) x {groups}", True
    else:
        samples, label, shared = TREE_SHAPES[tree].samples(loaded.vocab_size, 1234), f"`{tree}`", "tree"
    loaded.model.train()
    kernels_of, tokens_of, flops_of, outputs_of = {}, {}, {}, {}
    for share in (False, shared):
        # the unshared samples as `unshared_splits` micro-batches, cut as the bench cuts the rows whose
        # unshared micro-batch does not fit at once
        parts = split_in_order(samples, 1 if share else unshared_splits)
        layouts = [build_layout(part, share=share, vocab_size=loaded.vocab_size,
                                prompt_values=config.layout_prompt_values).to(loaded.device) for part in parts]
        masks = [response_row_mask(layout).to(loaded.device) for layout in layouts]
        count = float(sum(mask.sum() for mask in masks))
        side = "shared" if share else "unshared"
        tokens = tokens_of[side] = sum(layout.num_tokens for layout in layouts)
        by_layout = [flops_by_kind(counted, layout) for layout in layouts]
        flops_of[side] = {k: sum(f[k] for f in by_layout) for k in FLOP_KINDS}
        outputs_of[side] = sum(output_positions(layout) for layout in layouts)

        def actor():
            loaded.model.zero_grad(set_to_none=True)
            run_actor_step(loaded, layouts, masks, count, 1024)

        def logprob():
            with torch.no_grad():
                for layout in layouts:
                    row_logprobs(loaded, layout, chunk_rows=1024)

        packing = side + (f" x {len(layouts)}" if len(layouts) > 1 else "") \
            + (", graphs" if cuda_graphs else "")
        for what, fn in (("actor", actor), ("logprob", logprob)):
            for _ in range(3):  # with graphs: eager, captured, replayed
                fn()
            wall, host = _time(fn)
            gpu, launches, syncs, copies, averages, kernels, by_shape = _profiled(fn, shapes)
            line = (f"| {name} | {layers} | {label} | {packing} | {what} | {tokens} | "
                    f"{wall:.1f} | {host:.1f} | {gpu:.1f} | {wall / layers:.2f} | {host / layers:.2f} | "
                    f"{gpu / layers:.2f} | {launches} | {launches / layers:.0f} | {syncs} | {copies} |")
            print(line, flush=True)
            lines.append(line)
            kernels_of[(side, what)] = kernels
            stem = f"{name}_{packing.replace(', ', '-').replace(' x ', '-x')}_{what}"
            with open(os.path.join(out, f"profile_{stem}.txt"), "w") as f:
                f.write(f"{line}\n\nhost: top ops by self CPU time\n")
                f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
                f.write("\n\nGPU: top kernels by GPU time\n")
                f.write(averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
                if by_shape is not None:
                    f.write("\n\nGPU: top ops by GPU time, by input shapes\n")
                    f.write(by_shape.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=40,
                                           max_shapes_column_width=80))
            # every GPU kernel's and copy's time, for sums by kind of work (experts' GEMMs, attention, permutation)
            with open(os.path.join(out, f"kernels_{stem}.tsv"), "w") as f:
                f.write("name\tcalls\tgpu_us\n")
                for key, (calls, us) in sorted(kernels.items(), key=lambda item: -item[1][1]):
                    f.write(f"{key}\t{calls}\t{us:.1f}\n")
    token_ratio = tokens_of["unshared"] / tokens_of["shared"]
    ratios = expected_ratios(flops_of, outputs_of)
    flop_ratio = sum(flops_of["unshared"].values()) / sum(flops_of["shared"].values())
    for what in ("actor", "logprob"):
        table = kinds_table(kernels_of[("shared", what)], kernels_of[("unshared", what)], token_ratio, ratios, flop_ratio)
        print(f"\n{name}, {what}: GPU time by kind of work (S = {token_ratio:.2f})\n{table}\n", flush=True)
        kind_tables.append(f"{name}, {what} pass: GPU time by kind of work (S = {token_ratio:.2f})\n\n{table}")
    del loaded
    torch.cuda.empty_cache()


HEADER = ("| model | layers | row | packing | pass | packed tokens | wall ms | host ms | GPU busy ms | wall ms/layer | "
          "host ms/layer | GPU ms/layer | launches | launches/layer | syncs | memcpy |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    from ps_bridge.compat.quiet import quiet_third_party
    from ps_bridge.tools.bench.catalog import TREE_SHAPES

    quiet_third_party(verbose=False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3.5-0.8b,qwen2.5-0.5b")
    parser.add_argument("--row", default="128,32,8")
    parser.add_argument("--groups", type=int, default=4, help="prompts (groups of n responses) per micro-batch")
    parser.add_argument("--tree", choices=sorted(TREE_SHAPES), default=None,
                        help="a prefix-tree row of `ps-bridge bench --trees` instead of --row/--groups")
    parser.add_argument("--backend", default="flash_atten_gpu")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay the passes as CUDA graphs (PrefixSharingConfig.cuda_graphs): captured in the warm-up")
    parser.add_argument("--unshared-splits", type=int, default=1,
                        help="run the unshared samples as this many micro-batches, cut as the bench cuts them "
                             "where the unshared micro-batch does not fit at once")
    parser.add_argument("--shapes", action="store_true",
                        help="record the ops' input shapes: a table of the top ops by GPU time per input shape")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    row = tuple(int(x) for x in args.row.split(","))
    os.makedirs(args.out, exist_ok=True)
    print(HEADER, flush=True)
    lines, kind_tables = [], []
    for name in [m for m in args.models.split(",") if m]:
        profile_model(name, args.layers, row, args.groups, args.backend, args.out, lines, kind_tables,
                      args.cuda_graphs, args.unshared_splits, args.shapes, args.tree)
        with open(os.path.join(args.out, "profile-summary.md"), "w") as f:
            f.write(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n{HEADER}\n" + "\n".join(lines) + "\n")
            f.write("".join(f"\n{table}\n" for table in kind_tables))


if __name__ == "__main__":
    main()
