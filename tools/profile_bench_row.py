"""Profile one `ps-bridge bench` grid row on the GPU: where does the time of each packing go, host or GPU?

    python3 tools/profile_bench_row.py --models qwen3.5-0.8b,qwen2.5-0.5b --layers 24 --row 128,32,8 --groups 4 --out DIR

(`--cuda-graphs`: each pass captured in the warm-up and replayed when measured.)

Builds each model shape as the bench does (random weights, bf16), packs the row's micro-batch
unshared and shared, warms up, and for the actor step (forward, log-probs, loss, backward) and the
log-prob pass (forward only, no_grad) of each packing measures:
- wall: the step's time with the GPU work finished (median of 5, no profiler);
- host: the time until the step's Python returns, before waiting for the GPU (median of 5): when it
  is close to wall, the step is bound by host time (Python, launches, syncs), not by the GPU;
- GPU busy: the sum of the durations of its GPU kernels and copies (one profiled step);
- launches (CUDA and Triton kernel launches), syncs (stream/device/event synchronizations and
  blocking device-to-host reads: `.item()`, `.tolist()`), host-to-device copies (one profiled step).
Per layer = the figure over the decoder layers. One line per (model, packing, pass) to stdout and
DIR/profile-summary.md; per packing the top host ops (by self CPU time) and GPU kernels to
DIR/profile_<model>_<packing>_<pass>.txt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
H2D = ("cudaMemcpyAsync", "cudaMemcpy")


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


def _profiled(fn):
    """(GPU busy ms, launches, syncs, copies, key averages) of one step."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    gpu_us = sum(e.time_range.elapsed_us() for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    averages = prof.key_averages()
    count = {e.key: e.count for e in averages}
    launches = sum(count.get(k, 0) for k in LAUNCH)
    # the step's own final synchronize is not the step's
    syncs = sum(count.get(k, 0) for k in SYNC) - 1
    copies = sum(count.get(k, 0) for k in H2D)
    return gpu_us / 1e3, launches, syncs, copies, averages


def profile_model(name: str, layers_arg, row, groups: int, backend: str, out: str, lines: list,
                  cuda_graphs: bool = False) -> None:
    from ps_bridge.tools.bench.catalog import FAMILIES, MODEL_SHAPES, make_samples, response_row_mask
    from ps_bridge.tools.bench.timing import run_actor_step
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.layout import build_layout
    from ps_bridge.tools.runtime import load_model_from_hf_config, row_logprobs

    P, R, n = row
    shape = MODEL_SHAPES[name]
    layers = layers_arg or shape.bench_layers
    config = PrefixSharingConfig(enabled=True, backend=backend, pad_multiple=1, cuda_graphs=cuda_graphs)
    loaded = load_model_from_hf_config(FAMILIES[shape.family](shape.dims, layers), config, dtype=torch.bfloat16)
    samples = make_samples(P, R, n, groups, loaded.vocab_size, 1234)
    loaded.model.train()
    for share in (False, True):
        layout = build_layout(samples, share=share, vocab_size=loaded.vocab_size,
                              prompt_values=config.layout_prompt_values).to(loaded.device)
        mask = response_row_mask(layout).to(loaded.device)
        count = float(mask.sum())

        def actor():
            loaded.model.zero_grad(set_to_none=True)
            run_actor_step(loaded, [layout], [mask], count, 1024)

        def logprob():
            with torch.no_grad():
                row_logprobs(loaded, layout, chunk_rows=1024)

        packing = ("shared" if share else "unshared") + (", graphs" if cuda_graphs else "")
        for what, fn in (("actor", actor), ("logprob", logprob)):
            for _ in range(3):  # with graphs: eager, captured, replayed
                fn()
            wall, host = _time(fn)
            gpu, launches, syncs, copies, averages = _profiled(fn)
            line = (f"| {name} | {layers} | ({P}, {R}, {n}) x {groups} | {packing} | {what} | {layout.num_tokens} | "
                    f"{wall:.1f} | {host:.1f} | {gpu:.1f} | {wall / layers:.2f} | {host / layers:.2f} | "
                    f"{gpu / layers:.2f} | {launches} | {launches / layers:.0f} | {syncs} | {copies} |")
            print(line, flush=True)
            lines.append(line)
            with open(os.path.join(out, f"profile_{name}_{packing.replace(', ', '-')}_{what}.txt"), "w") as f:
                f.write(f"{line}\n\nhost: top ops by self CPU time\n")
                f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
                f.write("\n\nGPU: top kernels by GPU time\n")
                f.write(averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    del loaded
    torch.cuda.empty_cache()


HEADER = ("| model | layers | row | packing | pass | packed tokens | wall ms | host ms | GPU busy ms | wall ms/layer | "
          "host ms/layer | GPU ms/layer | launches | launches/layer | syncs | memcpy |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    from ps_bridge.compat.quiet import quiet_third_party

    quiet_third_party(verbose=False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3.5-0.8b,qwen2.5-0.5b")
    parser.add_argument("--row", default="128,32,8")
    parser.add_argument("--groups", type=int, default=4, help="prompts (groups of n responses) per micro-batch")
    parser.add_argument("--backend", default="flash_atten_gpu")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay the passes as CUDA graphs (PrefixSharingConfig.cuda_graphs): captured in the warm-up")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    row = tuple(int(x) for x in args.row.split(","))
    os.makedirs(args.out, exist_ok=True)
    print(HEADER, flush=True)
    lines = []
    for name in [m for m in args.models.split(",") if m]:
        profile_model(name, args.layers, row, args.groups, args.backend, args.out, lines, args.cuda_graphs)
        with open(os.path.join(args.out, "profile-summary.md"), "w") as f:
            f.write(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n{HEADER}\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
