"""The MoE layer alone: grouped experts (`models/experts.py`, megatron's TEGroupedMLP on grouped_mm)
vs megatron's SequentialMLP (one Python-loop GEMM pair per expert), forward + backward; and the
grouped layer once more with megatron's own token permutation instead of ours
(`models/token_permutation.py`).

Both layers are the one our Qwen3.5 MoE provider builds (router, token dispatcher, routed experts,
gated shared expert), taken from a one-layer model of the shape, with the same weights. The tokens are
a prefix-shared micro-batch's: `groups x (P + n R)` tokens of the grid row, random hidden states.

    python -m ps_bridge.tools.bench.moe_layer [--model qwen3.5-35b-a3b] [--grid 2048,512,8] [--groups 4] [--json FILE]
    python -m ps_bridge.tools.bench.moe_layer --smoke   # tiny shape on the CPU, bf16
    python -m ps_bridge.tools.bench.moe_layer --profile FILE   # also torch.profiler's table of one grouped step
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings

import torch

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.models.qwen35_specs import prefix_shared_qwen35_block_spec
from ps_bridge.models.token_permutation import use_gather_sum_permutation, use_megatron_permutation
from ps_bridge.tools.bench.catalog import FAMILIES, MODEL_SHAPES
from ps_bridge.tools.runtime import load_model_from_hf_config


def _sequential_twin(loaded, grouped):
    """megatron's SequentialMLP MoE layer with `grouped`'s weights (the provider's spec, grouped GEMM off)."""
    provider = loaded.provider
    provider.moe_grouped_gemm = False
    try:
        spec = prefix_shared_qwen35_block_spec(provider).layer_specs[0].submodules.mlp
        layer = spec(config=provider, layer_number=grouped.layer_number)  # a functools.partial of MoELayer
    finally:
        provider.moe_grouped_gemm = True
    layer.to(device=loaded.device, dtype=loaded.dtype)
    state = {k: v for k, v in grouped.state_dict().items() if not k.startswith("experts.")}
    missing, _ = layer.load_state_dict(state, strict=False)
    with torch.no_grad():
        for i, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(getattr(grouped.experts.linear_fc1, f"weight{i}"))
            expert.linear_fc2.weight.copy_(getattr(grouped.experts.linear_fc2, f"weight{i}"))
    assert all(k.startswith("experts.") for k in missing), missing
    return layer


def _step(layer, x, grad):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, _ = layer(x)
    out.backward(grad)
    return out.detach(), x.grad


def _time(layer, x, grad, warmup, repeats):
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(warmup):
        _step(layer, x, grad)
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        _step(layer, x, grad)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def host_syncs(layer, x, grad) -> list:
    """The calls in one forward + backward of `layer` that torch's sync debug mode reports as
    synchronising, each as its innermost three Python frames (`file:line` > ...). A true wait drains
    the GPU's queue of launched work; `host_waits` tells whether the host waited at all."""
    if not x.is_cuda:
        return []
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = traceback.extract_stack()[:-1][-3:]
            found.append(" > ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in frames))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(layer, x, grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def host_waits(layer, x, grad) -> bool:
    """Whether one forward + backward of `layer` makes the host wait for the GPU at all: the step is
    launched behind about a second of queued GPU work (`torch.cuda._sleep`); without a wait the host
    is done launching long before that work ends. Catches every kind of wait (event and stream
    synchronisation, blocking copies), where the sync debug mode of `host_syncs` misses some."""
    if not x.is_cuda:
        return False
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(10**7)
    torch.cuda.synchronize()
    ahead = 1.0  # seconds of GPU work queued ahead of the step
    cycles = int(ahead * 10**7 / (time.perf_counter() - t))
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    _step(layer, x, grad)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host > ahead / 2


def profile_table(layer, x, grad, path: str, rows: int = 40) -> None:
    """torch.profiler's operator table of one forward + backward of `layer` (after the timed runs),
    sorted by GPU kernel time, written to `path`: where the grouped layer's time goes."""
    # imported here: only --profile runs the profiler
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(activities=activities, record_shapes=False) as prof:
        _step(layer, x, grad)
        if x.is_cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if x.is_cuda else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=rows) + "\n")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def run(model: str, P: int, R: int, n: int, groups: int, warmup: int, repeats: int, seed: int, profile: str = None) -> dict:
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16  # grouped_mm's dtype (also on the CPU)
    shape = MODEL_SHAPES[model]
    hf_config = FAMILIES[shape.family](shape.dims, 1)
    loaded = load_model_from_hf_config(hf_config, PrefixSharingConfig(enabled=True), dtype=dtype)
    grouped = loaded.model.decoder.layers[0].mlp
    sequential = _sequential_twin(loaded, grouped)
    grouped.train()
    sequential.train()
    tokens = groups * (P + n * R)  # the prefix-shared micro-batch
    gen = torch.Generator(device=loaded.device).manual_seed(seed)
    hidden = int(loaded.provider.hidden_size)
    x = torch.randn(tokens, 1, hidden, generator=gen, device=loaded.device, dtype=dtype)
    grad = torch.randn(tokens, 1, hidden, generator=gen, device=loaded.device, dtype=dtype)

    with torch.no_grad():
        _, routing_map = grouped.router(x.view(tokens, hidden))
    per_expert = routing_map.sum(0).float()
    out_g, gx_g = _step(grouped, x, grad)
    out_s, gx_s = _step(sequential, x, grad)
    grouped_ms = _time(grouped, x, grad, warmup, repeats)
    sequential_ms = _time(sequential, x, grad, warmup, repeats)
    # the same grouped layer with megatron's own permutation (index_select / scatter_add_)
    use_megatron_permutation(grouped.token_dispatcher)
    out_m, gx_m = _step(grouped, x, grad)
    stock_permutation_ms = _time(grouped, x, grad, warmup, repeats)
    use_gather_sum_permutation(grouped.token_dispatcher)
    syncs = host_syncs(grouped, x, grad)
    waits = host_waits(grouped, x, grad)
    if profile:
        profile_table(grouped, x, grad, profile)
    p = loaded.provider
    return dict(
        model=model, P=P, R=R, n=n, groups=groups, dtype="bfloat16",
        device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
        experts=int(p.num_moe_experts), topk=int(p.moe_router_topk), hidden=hidden,
        expert_ffn=int(p.moe_ffn_hidden_size), shared_expert_ffn=int(p.moe_shared_expert_intermediate_size or 0),
        dispatcher=p.moe_token_dispatcher_type,
        tokens=tokens, routed_rows=int(per_expert.sum()),
        tokens_per_expert_mean=float(per_expert.mean()), tokens_per_expert_min=int(per_expert.min()),
        tokens_per_expert_max=int(per_expert.max()),
        grouped_ms=grouped_ms, sequential_ms=sequential_ms, speedup=sequential_ms / grouped_ms,
        grouped_megatron_permutation_ms=stock_permutation_ms,
        output_rel_diff=_rel(out_g, out_s), input_grad_rel_diff=_rel(gx_g, gx_s),
        permutation_output_rel_diff=_rel(out_g, out_m), permutation_input_grad_rel_diff=_rel(gx_g, gx_m),
        grouped_host_syncs=syncs, grouped_host_waits=waits,
        warmup=warmup, repeats=repeats,
        note="forward + backward of the whole MoE layer (router, dispatch, routed experts, shared expert), "
        "median ms; both layers have the same weights",
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ps_bridge.tools.bench.moe_layer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="MoE model shape (default qwen3.5-35b-a3b; --smoke: tiny-qwen3.5-moe)")
    parser.add_argument("--grid", default=None, help="P,R,n (default 2048,512,8; --smoke 24,8,4)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, runs on a CPU")
    parser.add_argument("--profile", default=None, metavar="FILE", help="write torch.profiler's table of one grouped step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("ps-bridge: error: the MoE layer bench needs a GPU; --smoke runs a tiny shape on the CPU", file=sys.stderr)
        return 2
    model = args.model or ("tiny-qwen3.5-moe" if args.smoke else "qwen3.5-35b-a3b")
    if model not in MODEL_SHAPES or MODEL_SHAPES[model].family != "qwen3.5-moe":
        moe = [k for k, v in MODEL_SHAPES.items() if v.family == "qwen3.5-moe"]
        print(f"ps-bridge: error: --model {model!r} is not a MoE shape; known: {', '.join(moe)}", file=sys.stderr)
        return 2
    P, R, n = (int(v) for v in (args.grid or ("24,8,4" if args.smoke else "2048,512,8")).split(","))
    result = run(model, P, R, n, args.groups, args.warmup, args.repeats, args.seed, args.profile)
    print(f"MoE layer {model} ({result['experts']} experts, top-{result['topk']}, hidden {result['hidden']}, "
          f"expert FFN {result['expert_ffn']}), {result['tokens']} tokens = {args.groups} x ({P} + {n} x {R}), "
          f"{result['routed_rows']} routed rows, tokens per expert mean {result['tokens_per_expert_mean']:.0f} "
          f"(min {result['tokens_per_expert_min']}, max {result['tokens_per_expert_max']}), bf16, fwd+bwd: "
          f"grouped {result['grouped_ms']:.2f} ms, sequential {result['sequential_ms']:.2f} ms, "
          f"{result['speedup']:.1f}x; grouped vs sequential output rel. diff {result['output_rel_diff']:.2e}, "
          f"input grad {result['input_grad_rel_diff']:.2e}; grouped with megatron's permutation "
          f"{result['grouped_megatron_permutation_ms']:.2f} ms (vs ours: output {result['permutation_output_rel_diff']:.2e}, "
          f"input grad {result['permutation_input_grad_rel_diff']:.2e}); host syncs in a grouped step: "
          f"{len(result['grouped_host_syncs'])} {result['grouped_host_syncs'] or ''}, host waits for the GPU: "
          f"{'yes' if result['grouped_host_waits'] else 'no'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
