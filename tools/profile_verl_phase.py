"""Profile one verl-check phase on the GPU: where does the time of the stock and the prefix-shared engine go?

    python3 tools/profile_verl_phase.py --model qwen2.5-7b --layers 4 --prompts 32 --n 8 \
        --system-prompt-len 2048 --prompt-len 512 --response-len 512 --phase update --out DIR [OVERRIDES...]

    python3 tools/profile_verl_phase.py --model qwen3.5-9b-vl --layers 4 --images 1 --image-size 1024x1024 \
        --prompts 8 --n 8 --prompt-len 256 --response-len 512 --phase old_log_prob,update --python-profile ...

Builds verl-check's checkpoint, trainer config and synthetic batches (`ps_bridge.tools.verl_check`; with
`--images`, verl's multi_modal_inputs per sample, as `verl-check --images`), then per engine kind
(`--kinds`, default stock and shared) runs verl-check's trainer steps: the first `--warmup-steps` (default 1)
warm up, the next runs each `--phase` under torch's profiler, the one after under CUDA's sync-debug mode (and
with `--python-profile` under cProfile). With `PS_BRIDGE_CUDA_GRAPHS=1` give two warm-up steps: a structure
is captured the second time it runs, so the profiled step replays. Reports per kind and phase:
- wall: the phase's time (profiled step), GPU busy: the union of its kernels' and copies' intervals, idle =
  wall - busy (time the GPU waited for the host);
- host seconds inside our forward step's parts and verl's loss (timers around them, profiled step);
- idle by host range: the GPU's idle gaps inside the profiled phase, each moment attributed to the
  innermost timed range the host was in (what the GPU waited for), and the longest gaps;
- syncs: the calls that made the host wait for the GPU (`torch.cuda.set_sync_debug_mode`), counted by
  their innermost project / verl / megatron frames (the sync-debug step);
- the top host ops by self CPU time and GPU kernels by time (DIR/profile_verl_<kind>_<phase>.txt), and
  with `--python-profile` the top Python functions by own and inner time (there too).
A diagnostic, not a measurement of speed-up (that is `ps-bridge verl-check`'s job).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import json
import os
import pstats
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile, record_function

TIMED = {}  # "module:function" -> seconds of host time in the profiled step
TIMED_LABELS = {"phase"}  # the profiler ranges of the timers, and the phase's own


def _timed(owner, name: str, label: str):
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            with record_function(label):
                return inner(*args, **kwargs)
        finally:
            TIMED[label] = TIMED.get(label, 0.0) + time.perf_counter() - t0

    TIMED_LABELS.add(label)
    setattr(owner, name, wrapper)


def _install_timers() -> None:
    """Timers (and profiler ranges, for the idle attribution) around our forward step's parts, the
    micro-batching, verl's loss and optimizer step, megatron's backward and grad norm."""
    import ps_bridge.verl.engine as engine
    import ps_bridge.verl.micro_batches as mb
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.megatron import transformer_impl
    from verl.workers.utils import losses

    import ps_bridge.layout as layout
    import ps_bridge.verl.batch as batch
    from ps_bridge.packed_layout import PackedPrefixLayout

    for name in ("micro_batch_layout", "samples_of", "stock_row_labels", "run_packed", "PackedRows"):
        _timed(engine, name, f"engine.{name}")
    # what reads the images of the batch: verl's entries, the pack's tower inputs, their copy to the device
    for name in ("has_multi_modal_inputs", "samples_with_images", "samples_from_micro_batch"):
        _timed(batch, name, f"batch.{name}")
    _timed(layout, "pack_images", "layout.pack_images")
    _timed(PackedPrefixLayout, "to", "layout.to")
    _timed(mb, "batch_plan", "micro_batches.batch_plan")
    _timed(engine.PrefixSharingEngineMixin, "_packed_outputs", "engine._packed_outputs")
    _timed(engine.PrefixSharingEngineMixin, "forward_step", "engine.forward_step")
    _timed(transformer_impl.MegatronEngineWithLMHead, "forward_step", "stock.forward_step")
    _timed(transformer_impl.MegatronEngine, "optimizer_step", "verl.optimizer_step")
    _timed(transformer_impl.MegatronEngine, "optimizer_zero_grad", "verl.optimizer_zero_grad")
    _timed(transformer_impl.MegatronEngine, "forward_backward_batch", "verl.forward_backward_batch")
    _timed(mb, "prefix_aware_micro_batches", "micro_batches.prefix_aware_micro_batches")
    _timed(mb, "batch_costs", "micro_batches.batch_costs")
    _timed(mb, "subtree_units", "micro_batches.subtree_units")
    _timed(mb, "first_fit_decreasing", "micro_batches.first_fit_decreasing")
    _timed(mb, "mark_plan", "micro_batches.mark_plan")
    _timed(tu, "index_select_tensor_dict", "verl.index_select_tensor_dict")
    _timed(losses, "ppo_loss", "verl.ppo_loss")
    _timed(schedules, "backward_step", "megatron.backward_step")
    _timed(clip_grads, "get_grad_norm_fp32", "megatron.get_grad_norm_fp32")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_debug(mode) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


def _device_spans(events):
    """The (start, end) of every kernel and copy on the GPU, sorted; our ranges' device-side copies
    (the profiler mirrors each `record_function` range on the GPU's timeline) left out."""
    return sorted((e.time_range.start, e.time_range.end) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in TIMED_LABELS)


def _busy_seconds(prof) -> float:
    spans = _device_spans(prof.events())
    busy, end = 0, None
    for s, e in spans:
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / 1e6


def _idle_by_host_range(prof, window_label: str, min_gap_us: float = 20.0) -> dict:
    """The GPU's idle time inside the profiled phase (`window_label`'s range), attributed to what the
    host was doing meanwhile: the innermost of our timed ranges (`_install_timers`) active at each
    moment of each gap, "(none)" outside them. Gaps shorter than `min_gap_us` are left out (kernel
    launch spacing). Returns {label: [seconds, gaps touched]}, largest first, and the 15 longest gaps."""
    import bisect

    events = list(prof.events())
    spans = _device_spans(events)
    ranges = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                    if e.device_type == torch.autograd.DeviceType.CPU and e.name in TIMED_LABELS)
    window = [(a, b) for a, b, n in ranges if n == window_label]
    if not window:
        return {}
    w0, w1 = window[0][0], window[-1][1]
    gaps, end = [], w0
    for s, e in spans:
        if e <= w0 or s >= w1:
            continue
        if s > end and s - end >= min_gap_us:
            gaps.append((end, s))
        end = max(end, e)
    if w1 - end >= min_gap_us:
        gaps.append((end, w1))
    starts = [r[0] for r in ranges]
    totals: dict = {}
    longest = []
    for g0, g1 in gaps:
        active = [r for r in ranges[:bisect.bisect_right(starts, g1)] if r[1] > g0 and r[2] != window_label]
        cuts = sorted({g0, g1, *[max(g0, r[0]) for r in active], *[min(g1, r[1]) for r in active]})
        touched = set()
        for a, b in zip(cuts[:-1], cuts[1:]):
            inner = [r for r in active if r[0] <= a and r[1] >= b]
            name = max(inner, key=lambda r: r[0])[2] if inner else "(none)"
            slot = totals.setdefault(name, [0.0, 0])
            slot[0] += (b - a) / 1e6
            touched.add(name)
        for name in touched:
            totals[name][1] += 1
        longest.append((g1 - g0, g0 - w0, sorted(touched)))
    longest.sort(reverse=True)
    out = {k: [round(v[0], 4), v[1]] for k, v in sorted(totals.items(), key=lambda kv: -kv[1][0])}
    return {"idle_by_host_range": out, "gaps": len(gaps), "idle_in_gaps_s": round(sum(b - a for a, b in gaps) / 1e6, 4),
            "longest_gaps_ms_at_ms": [[round(d / 1e3, 2), round(t / 1e3, 1), n] for d, t, n in longest[:15]]}


INTERESTING = ("ps_bridge", "verl", "megatron", "tensordict")


def _sync_site() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if any(k in f.filename for k in INTERESTING)]
    keep = frames[-3:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(keep)) or "?"


def _python_top(stats_profile, rows: int = 15) -> str:
    """The `rows` functions of a cProfile run with the most own time, then with the most time inside."""
    out = io.StringIO()
    stats = pstats.Stats(stats_profile, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def run(args) -> None:
    from omegaconf import OmegaConf
    from ps_bridge.tools.verl_check.side_by_side import prepare_side_by_side

    prepare_side_by_side()  # as `ps-bridge verl-check`: verl's imports in the order that works without TE
    from ps_bridge.tools.verl_check import roles
    from ps_bridge.tools.verl_check.config import CheckSettings, trainer_config
    from ps_bridge.tools.verl_check.model import checkpoint_for
    from ps_bridge.tools.verl_check.run import kind_steps, synthetic_batches

    size = tuple(int(x) for x in args.image_size.lower().split("x"))
    settings = CheckSettings(model=args.model, layers=args.layers, prompts=args.prompts, n=args.n,
                             prompt_len=args.prompt_len, system_prompt_len=args.system_prompt_len,
                             response_len=args.response_len, steps=args.warmup_steps + 2, overrides=list(args.overrides),
                             dtype=args.dtype, workdir=args.workdir, images=args.images, image_size=size,
                             baseline_graphs=None if args.baseline_graphs is None else args.baseline_graphs == "on")
    cfg = trainer_config(settings)
    ckpt = checkpoint_for(settings, args.workdir)
    OmegaConf.to_container(cfg.algorithm, resolve=True)  # the trainer config resolves (as verl-check's)
    batches, _ = synthetic_batches(settings, cfg, ckpt)
    _install_timers()
    phases = args.phase.split(",")
    # the role call of each phase: infer is the actor's first (old log-probs), then the ref's
    calls = {"old_log_prob": ("infer", 0), "ref": ("infer", 1), "update": ("train", 0)}
    mode = {"step": 0}
    report = {}
    originals = {method: getattr(roles.Role, method) for method in ("infer", "train")}

    def profiled(phase, original, self, td):
        if mode["step"] == args.warmup_steps:
            TIMED.clear()
            _sync()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("phase"):
                    out = original(self, td)
                    _sync()
            wall = time.perf_counter() - t0
            res = mode["result"].setdefault(phase, {})
            res.update(wall_s=wall, gpu_busy_s=_busy_seconds(prof), host_s=dict(TIMED))
            res["idle_s"] = wall - res["gpu_busy_s"]
            res.update(_idle_by_host_range(prof, "phase"))
            if args.trace:
                prof.export_chrome_trace(os.path.join(args.out, f"trace_{kind_now['kind']}_{phase}.json"))
            mode["averages"][phase] = prof.key_averages()
            return out
        sites = collections.Counter()

        def hook(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                sites[_sync_site()] += 1

        saved = warnings.showwarning
        warnings.showwarning = hook
        _sync_debug("warn")
        python = cProfile.Profile() if args.python_profile else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = hook
                t0 = time.perf_counter()
                if python is not None:
                    python.enable()
                out = original(self, td)
                _sync()
                if python is not None:
                    python.disable()
                wall = time.perf_counter() - t0
        finally:
            _sync_debug(0)
            warnings.showwarning = saved
        res = mode["result"].setdefault(phase, {})
        res["syncs"] = dict(sites.most_common())
        res["sync_count"] = sum(sites.values())
        if python is not None:
            res["python_profiled_wall_s"] = wall
            mode["python"][phase] = _python_top(python)
        return out

    def wrap(method):
        original = originals[method]

        def wrapped(self, td):
            mine = mode["seen"].setdefault((method, id(self)), len({k for k in mode["seen"] if k[0] == method}))
            phase = next((p for p in phases if calls[p] == (method, mine)), None)
            if mode["step"] < args.warmup_steps or phase is None:
                return original(self, td)
            return profiled(phase, original, self, td)

        return wrapped

    for method in originals:
        setattr(roles.Role, method, wrap(method))
    kind_now = {}
    for kind in args.kinds.split(","):
        kind_now["kind"] = kind
        mode.update(step=0, seen={}, result={}, averages={}, python={})
        gen = kind_steps(kind, settings, ckpt, cfg, batches, lambda m: None)
        try:
            for step in range(args.warmup_steps + 2):
                mode["step"] = step
                rec = next(gen)
                seconds = {k: round(v, 3) for k, v in rec["phase_seconds"].items()}
                how = ("" if step < args.warmup_steps else "  (profiled)" if step == args.warmup_steps
                       else "  (sync debug, cProfile)" if args.python_profile else "  (sync debug)")
                print(f"[{kind}] step {step + 1}: phase seconds {seconds}  micro-batches {rec['micro_batches']}{how}",
                      flush=True)
        finally:
            gen.close()
        report[kind] = mode["result"]
        print(json.dumps({kind: mode["result"]}, indent=1), flush=True)
        for phase in phases:
            with open(os.path.join(args.out, f"profile_verl_{kind}_{phase}.txt"), "w") as f:
                averages = mode["averages"][phase]
                f.write(json.dumps(mode["result"].get(phase, {}), indent=1) + "\n\nhost: top ops by self CPU time\n")
                f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
                f.write("\n\nGPU: top kernels by GPU time\n")
                f.write(averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
                if phase in mode["python"]:
                    f.write("\n\nPython functions (cProfile of the sync-debug step's phase)\n" + mode["python"][phase])
        with open(os.path.join(args.out, f"profile_verl_{'-'.join(phases)}.json"), "w") as f:
            json.dump(report, f, indent=1)


def main() -> None:
    from ps_bridge.compat.quiet import quiet_third_party

    quiet_third_party(verbose=False)
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--system-prompt-len", type=int, default=2048)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--phase", default="update",
                   help="old_log_prob, ref or update, or several comma-separated (profiled in the same steps)")
    p.add_argument("--images", type=int, default=0, help="images per prompt (a vision-language --model)")
    p.add_argument("--image-size", default="1024x1024", help="HxW pixels of each image")
    p.add_argument("--python-profile", action="store_true",
                   help="also run the sync-debug step's phases under cProfile: the top Python functions by own and "
                        "inner time in the report (its overhead inflates that step's times)")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="trainer steps before the profiled one (2 with PS_BRIDGE_CUDA_GRAPHS=1: captured, then replayed)")
    p.add_argument("--baseline-graphs", choices=("on", "off"), default=None,
                   help="CUDA graphs of the stock kind (our engine with sharing off); default PS_BRIDGE_CUDA_GRAPHS")
    p.add_argument("--kinds", default="shared,stock")
    p.add_argument("--workdir", default="/tmp/verl-check")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--trace", action="store_true", help="also write the profiled phase's chrome trace")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    bad = [x for x in args.phase.split(",") if x not in ("old_log_prob", "ref", "update")]
    if bad:
        p.error(f"--phase: unknown phase(s) {bad} (old_log_prob, ref, update)")
    os.makedirs(args.out, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
