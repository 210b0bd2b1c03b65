"""Profile one `ps-bridge bench` grid row on the GPU: where does the shared actor step's time go?

    python3 scripts/profile_bench_row.py --model qwen3.5-0.8b --row 2048,512,8 --out DIR

Builds the model shape as the bench does, warms up, then records one actor step (forward, log-probs,
loss, backward) of each packing with torch.profiler and writes the top GPU kernels of each to
DIR/profile_{unshared,shared}.txt, and a side-by-side summary to stdout.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    from ps_bridge.compat.quiet import quiet_third_party

    quiet_third_party(verbose=False)
    from ps_bridge.bench.catalog import FAMILIES, MODEL_SHAPES, make_samples, response_row_mask
    from ps_bridge.bench.timing import run_actor_step
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.layout import build_layout
    from ps_bridge.runtime import load_model_from_hf_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3.5-0.8b")
    parser.add_argument("--row", default="2048,512,8")
    parser.add_argument("--backend", default="flash_atten_gpu")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    P, R, n = (int(x) for x in args.row.split(","))
    shape = MODEL_SHAPES[args.model]
    layers = args.layers or shape.bench_layers
    config = PrefixSharingConfig(enabled=True, backend=args.backend, pad_multiple=1)
    loaded = load_model_from_hf_config(FAMILIES[shape.family](shape.dims, layers), config, dtype=torch.bfloat16)
    samples = make_samples(P, R, n, 1, loaded.vocab_size, 1234)
    summary = {}
    for share in (False, True):
        layout = build_layout(samples, share=share, vocab_size=loaded.vocab_size,
                              prompt_values=config.layout_prompt_values).to(loaded.device)
        mask = response_row_mask(layout).to(loaded.device)
        count = float(mask.sum())

        def step():
            loaded.model.zero_grad(set_to_none=True)
            run_actor_step(loaded, [layout], [mask], count, 1024)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        name = "shared" if share else "unshared"
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
        with open(os.path.join(args.out, f"profile_{name}.txt"), "w") as f:
            f.write(table)
        kernels = {e.key: e.device_time_total for e in prof.key_averages() if e.device_time_total > 0}
        summary[name] = kernels
        print(f"== {args.model} {args.row} {name}: {len(layout.tokens)} tokens")
        print(table)
    # kernels by GPU time, unshared vs shared (ms), the largest first
    names = sorted(set(summary["unshared"]) | set(summary["shared"]),
                   key=lambda k: -max(summary["unshared"].get(k, 0), summary["shared"].get(k, 0)))
    print(f"{'kernel':70s} {'unshared ms':>12s} {'shared ms':>10s} {'ratio':>6s}")
    for k in names[:40]:
        u, s = summary["unshared"].get(k, 0) / 1e3, summary["shared"].get(k, 0) / 1e3
        print(f"{k[:70]:70s} {u:12.2f} {s:10.2f} {u / s if s else float('inf'):6.2f}")


if __name__ == "__main__":
    main()
