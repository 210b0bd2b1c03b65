"""`python -m ps_bridge.tools.grpo`: verl's own `main_ppo` GRPO twice from the same seed, with verl's stock
Megatron engine and with ps-bridge, on a tiny Qwen2.5 and GSM8K-format arithmetic built here (`data.py`);
then the side-by-side table, the verdict (`report.py`) and the curves.

Runs, each one `launch.run_main_ppo` in its own folder under --out:
- `stock`, `ps`: the pair (ps saves a checkpoint at step 3 when the resume check is on);
- `ps-resumed` (--resume): ps again from its step-3 checkpoint to the last step;
- `stock-system`, `ps-tree` (--tree): the same problems behind one shared system prompt, ps with
  `PS_BRIDGE_TREE=1`;
- `stock-floor` (--noise-floor, or `auto` when the pair's rollouts differ after step 1): stock with another
  micro-batch split, the float32 noise floor; `stock-system-floor` the same for the tree pair.

With `--model qwen3.5` (a tiny Qwen3.5, under --out/qwen3.5) the baseline is ps-bridge's engine with
`PS_BRIDGE_SHARING=off`, labelled `ps-off` in place of `stock`: megatron's stock engine does not build
Qwen3.5 on a CPU (its Gated DeltaNet layer spec needs Transformer Engine), so what the pair shows there is
sharing on against sharing off through the whole job, vLLM included.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from tqdm import tqdm

from ps_bridge.compat.quiet import quiet_third_party
from ps_bridge.tools.grpo import report
from ps_bridge.tools.grpo.launch import RunSpec, cpu_hybrid_rollout_refusal, run_main_ppo
from ps_bridge.tools.grpo.report import Check, RunData

RESUME_AFTER = 3  # the checkpoint step the resume check restarts from
# samples per micro-batch (actor, ref and old log-probs): 4 = the size of one prompt's group at n = 4 (which samples
# share a micro-batch follows the order in which verl's asynchronous rollout hands them over); the floor splits it;
# the tree pair takes both prompts of a step in one micro-batch, so the system prompt is shared across prompts
MICRO_BATCH, FLOOR_MICRO_BATCH, TREE_MICRO_BATCH = 4, 2, 8
TREE_FLOOR_MICRO_BATCH = 4  # half of the tree pair's micro-batch: stock's float32 sums in another grouping
# the least share of right answers the format fit must leave (sampled after the fit, in each prompt form): at 8
# responses per step, a model right on 1 in 8 draws no right answer in 3 steps with probability 0.04, and such
# a run's advantages are all 0: its weights never move, so the verdict could not tell stale weights in vLLM
MIN_RIGHT = 1 / 8


class WeakFit(RuntimeError):
    """The format fit left the model right on fewer than MIN_RIGHT of its sampled answers."""


class RunFailed(RuntimeError):
    def __init__(self, label: str, returncode: int, log_path: Path, hint: str):
        super().__init__(f"the {label} run stopped (exit {returncode}): {hint}\n  its log: {log_path}")
        self.label, self.returncode, self.log_path = label, returncode, log_path


_ERROR_LINE = re.compile(r"(Error|Exception|error:|refused|Killed)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _last_error(log_path: Path) -> str:
    """The last line of the log that names an error (people read this line; the log has the traceback)."""
    if not log_path.exists():
        return "no log written"
    text = _ANSI.sub("", log_path.read_text(errors="replace"))  # Ray colours its workers' prefixes
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return (errors or lines or ["empty log"])[-1][-300:]


@dataclass
class Plan:
    out: Path
    steps: int
    seed: int = 1
    resume: bool = False
    tree: bool = False
    noise_floor: str = "auto"  # on | off | auto
    reuse: bool = False
    model: str = "qwen2.5"
    runs: Dict[str, RunData] = field(default_factory=dict)

    @property
    def base(self) -> str:
        """The baseline's label: verl's stock engine, or ps-bridge's with sharing off where stock cannot run."""
        return "stock" if self.model == "qwen2.5" else "ps-off"

    @property
    def base_spec(self) -> dict:
        return dict(engine="stock") if self.model == "qwen2.5" else dict(engine="ps", sharing=False)

    @property
    def run_dir(self) -> Path:
        return self.out if self.model == "qwen2.5" else self.out / self.model


class Progress:
    """One bar over all planned steps; launch's lines above it."""

    _DONE = re.compile(r"step (\d+)/(\d+) done")

    def __init__(self, total_steps: int, verbose: bool):
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=sys.stderr,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}<{remaining}]")
        self.verbose = verbose
        self._seen = set()

    def add(self, steps: int) -> None:
        self.bar.total += steps
        self.bar.refresh()

    def line(self, label: str) -> Callable[[str], None]:
        """launch's progress callback for the run `label`: step lines move the bar; other lines are shown once
        per kind (every one with -v)."""
        def say(text: str) -> None:
            body = re.sub(r"^(ps|stock): ", "", text)
            m = self._DONE.search(body)
            if m:
                if (label, m.group(1)) not in self._seen:
                    self._seen.add((label, m.group(1)))
                    self.bar.update(1)
                self.bar.set_description_str(label)
            kind = (label, re.sub(r"\d+", "#", body)[:40])
            if self.verbose or (not m and kind not in self._seen):
                self._seen.add(kind)
                self.bar.write(f"  {label}: {body}")
        return say

    def write(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()


def build_data(out: Path, seed: int, say: Callable[[str], None], model: str = "qwen2.5"):
    # imported here: ps_bridge.tools.grpo.data imports torch, which is heavy (only building the data needs it)
    from ps_bridge.tools.grpo import data

    start = time.time()
    last = {}

    def progress(what, done, total):
        if what != last.get("what") or done == total:
            last["what"] = what
            say(f"data: {what} {done}/{total}")

    built = data.build(out / "data", seed=seed, model=model, progress=progress)
    say(f"data: tiny {'Qwen2.5' if model == 'qwen2.5' else 'Qwen3.5'} (vocab {built.vocab_size}, tokenizer {built.tokenizer_size} tokens), "
        f"sampled answers right after the format fit: {built.fit.correct}/{built.fit.sampled} "
        f"({built.fit.formatted} formatted), behind the system prompt {built.fit.system_correct}/"
        f"{built.fit.system_sampled} ({built.fit.system_formatted} formatted) [{time.time() - start:.0f} s]")
    fit = built.fit
    right = min(fit.correct / max(fit.sampled, 1), fit.system_correct / max(fit.system_sampled, 1))
    if fit.steps > 0 and right < MIN_RIGHT:
        raise WeakFit(
            f"the format fit left the model right on {fit.correct}/{fit.sampled} sampled answers "
            f"({fit.system_correct}/{fit.system_sampled} behind the system prompt), below {MIN_RIGHT:.3f}: "
            f"GRPO's advantages would be 0 at most steps. Try another --seed (data in {out / 'data'})")
    return built


def launch(label: str, engine: str, model: str, data_dir: str, out: Path, steps: int, seed: int,
           max_prompt_length: int, say: Callable[[str], None], reuse: bool = False, **spec_kwargs) -> RunData:
    """One `main_ppo` run into out/label; with `reuse`, a finished run of the same spec is read back instead."""
    run_dir = out / label
    spec = RunSpec(engine=engine, model_dir=Path(model), data_dir=Path(data_dir), out_dir=run_dir, seed=seed,
                   steps=steps, max_prompt_length=max_prompt_length, **spec_kwargs)
    key = json.dumps({k: str(v) for k, v in asdict(spec).items() if k != "timeout_s"}, sort_keys=True)
    done = run_dir / "done.json"
    if reuse and done.exists() and json.loads(done.read_text()).get("spec") == key:
        say(f"reusing the finished run in {run_dir}")
        for k in range(1, steps + 1):
            say(f"step {k}/{steps} done (reused)")
        return report.load_run(label, run_dir)
    if done.exists():
        done.unlink()
    result = run_main_ppo(spec, progress=say)
    if not result.ok or len(result.steps) < steps - (spec.resume_from is not None) * RESUME_AFTER:
        raise RunFailed(label, result.returncode, result.log_path, _last_error(result.log_path))
    done.write_text(json.dumps({"spec": key, "seconds": result.seconds}))
    return report.load_run(label, run_dir)


def run_plan(plan: Plan, progress: Progress, extra_ps_overrides: Sequence[str] = ()) -> List[Check]:
    """Build the data, run what `plan` asks for, return the verdict's checks (runs land in plan.runs)."""
    out = plan.run_dir
    built = build_data(out, plan.seed, progress.write, plan.model)
    base, base_spec = plan.base, plan.base_spec
    common = dict(seed=plan.seed, reuse=plan.reuse, micro_batch=MICRO_BATCH)
    save = dict(save_freq=RESUME_AFTER) if plan.resume else {}
    runs = plan.runs

    def go(label, engine, system=False, **kw):
        length = built.system_max_prompt_tokens if system else built.max_prompt_tokens
        kwargs = {**common, **kw}
        runs[label] = launch(label, engine, built.model, built.dir(system), out, plan.steps,
                             max_prompt_length=length, say=progress.line(label), **kwargs)
        return runs[label]

    # only ps saves: the resume check restarts ps-bridge's run (verl's HF export of the stock engine also needs
    # NVIDIA modelopt, which ps-bridge's engine does without: ps_bridge/checkpoint_engine.py)
    stock = go(base, **base_spec)
    ps = go("ps", "ps", extra_overrides=tuple(extra_ps_overrides), **save)
    pair_diffs = report.rollout_differences(stock, ps, stock.step_numbers())
    flip = report.first_divergence(pair_diffs)
    floor = None
    if plan.noise_floor == "on" or (plan.noise_floor == "auto" and flip is not None and flip > 1):
        if plan.noise_floor == "auto":  # not counted in planned_steps
            progress.add(plan.steps)
        floor = go(f"{base}-floor", micro_batch=FLOOR_MICRO_BATCH, **base_spec)
    checks = report.compare_runs(stock, ps, floor)
    checks += report.compare_log_probs(stock, ps)
    checks += report.check_logs(stock, ps, baseline_sharing_off=base != "stock")
    if floor is not None:
        checks += _floor_sizes(stock, floor)

    if plan.resume:
        resumed = go("ps-resumed", "ps", resume_from=out / "ps" / "ckpt" / f"global_step_{RESUME_AFTER}",
                     extra_overrides=tuple(extra_ps_overrides))
        checks += report.check_resume(ps, resumed, RESUME_AFTER)
    if plan.tree:
        stock_sys = go(f"{base}-system", system=True, micro_batch=TREE_MICRO_BATCH, **base_spec)
        tree = go("ps-tree", "ps", system=True, tree=True, micro_batch=TREE_MICRO_BATCH,
                  extra_overrides=tuple(extra_ps_overrides))
        tree_flip = report.first_divergence(report.rollout_differences(stock_sys, tree, stock_sys.step_numbers()))
        tree_floor = None
        if plan.noise_floor == "on" or (plan.noise_floor == "auto" and tree_flip is not None and tree_flip > 1):
            if plan.noise_floor == "auto":
                progress.add(plan.steps)
            tree_floor = go(f"{base}-system-floor", system=True, micro_batch=TREE_FLOOR_MICRO_BATCH, **base_spec)
        name = "system prompt, tree"
        checks += report.compare_runs(stock_sys, tree, tree_floor, name=name)
        checks += report.check_logs(stock_sys, tree, tree=True, name=name, baseline_sharing_off=base != "stock")
        checks += report.compare_log_probs(stock_sys, tree, name=name)
        if tree_floor is not None:
            checks += _floor_sizes(stock_sys, tree_floor, name)
    return checks


def _floor_sizes(stock: RunData, floor: RunData, name: str = "") -> List[Check]:
    """The floor's own agreement with stock, shown beside the verdict (never judged): the size float32 rounding
    alone leaves in the step metrics and in the token log-probs."""
    tag = f"{name}: " if name else ""
    sizes = [c for c in report.compare_runs(stock, floor) if "equal while rollouts are identical" in c.name]
    sizes += report.compare_log_probs(stock, floor)
    return [Check(f"{tag}noise floor: {c.name}", None if c.ok is False else True, c.detail) for c in sizes]


def planned_steps(plan: Plan) -> int:
    total = 2 * plan.steps
    if plan.resume:
        total += plan.steps - RESUME_AFTER
    if plan.tree:
        total += 2 * plan.steps
    if plan.noise_floor == "on":
        total += plan.steps * (1 + plan.tree)
    return total


def write_outputs(plan: Plan, checks: Sequence[Check], say: Callable[[str], None], png: bool = True) -> bool:
    runs, base = plan.runs, plan.base
    pair = [runs[k] for k in (base, "ps", f"{base}-floor") if k in runs]
    say(f"\nper step (|diff| against {base}; 'rollouts differ': responses of the step that differ from {base}'s)")
    say(report.metrics_table(pair))
    say("\nseconds per phase (verl's timing_s/*)")
    say(report.timing_table(pair))
    if "ps-tree" in runs:
        say("\nsystem prompt shared across prompts, PS_BRIDGE_TREE=1")
        say(report.metrics_table([runs[k] for k in (f"{base}-system", "ps-tree", f"{base}-system-floor") if k in runs]))
    say("")
    say(report.verdict_text(checks))
    ok = report.passed(checks)
    (plan.run_dir / "verdict.json").write_text(json.dumps(
        {"passed": ok, "checks": [asdict(c) for c in checks], "runs": sorted(runs)}, indent=1))
    if png:
        try:
            groups = [(f"{base} vs ps-bridge", [runs[k] for k in (base, "ps", "ps-resumed", f"{base}-floor") if k in runs])]
            if "ps-tree" in runs:
                groups.append(("system prompt, tree",
                               [runs[k] for k in (f"{base}-system", "ps-tree", f"{base}-system-floor") if k in runs]))
            title = ("verl main_ppo GRPO, the same seed: verl's stock engine and ps-bridge" if base == "stock" else
                     f"verl main_ppo GRPO on {plan.model}, the same seed: ps-bridge with sharing off and on")
            path = report.plot(groups, plan.run_dir / "grpo.png", suptitle=title)
            say(f"curves: {path}")
        except ImportError:
            say("curves: not drawn (matplotlib is not installed: pip install 'ps-bridge[plot]')")
    return ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ps_bridge.tools.grpo",
        description="verl's main_ppo GRPO with verl's stock engine and with ps-bridge from one seed: table, verdict, PNG.")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 5; --short: 3)")
    p.add_argument("--short", action="store_true", help="the CI form: the pair only, 3 steps")
    p.add_argument("--out", default="outputs/grpo", help="output folder (default outputs/grpo)")
    p.add_argument("--model", choices=("qwen2.5", "qwen3.5"), default="qwen2.5",
                   help="the tiny model (qwen3.5: against ps-bridge with sharing off, in OUT/qwen3.5)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                   help="also resume ps from its step-3 checkpoint and compare steps 4.. (default: on unless --short)")
    p.add_argument("--tree", action=argparse.BooleanOptionalAction, default=None,
                   help="also run a shared system prompt with PS_BRIDGE_TREE=1 against stock (default: on unless --short)")
    p.add_argument("--noise-floor", choices=("auto", "on", "off"), default="auto",
                   help="stock against stock with another micro-batch split (auto: when the pair's rollouts differ)")
    p.add_argument("--reuse", action="store_true", help="read back runs already finished with the same settings")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="every progress line, and tracebacks")
    args = p.parse_args(argv)
    quiet_third_party(args.verbose)  # transformers' warnings and progress bars while the data is built
    steps = args.steps or (3 if args.short else 5)
    resume = (not args.short) if args.resume is None else args.resume
    tree = (not args.short) if args.tree is None else args.tree
    if resume and steps <= RESUME_AFTER:
        p.error(f"--resume restarts from the step-{RESUME_AFTER} checkpoint: use --steps {RESUME_AFTER + 1} or more")
    refusal = cpu_hybrid_rollout_refusal() if args.model == "qwen3.5" else None
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    plan = Plan(out=Path(args.out), steps=steps, seed=args.seed, resume=resume, tree=tree,
                noise_floor=args.noise_floor, reuse=args.reuse, model=args.model)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(planned_steps(plan), args.verbose)
    try:
        checks = run_plan(plan, progress)
    except (RunFailed, WeakFit) as e:
        progress.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        progress.close()
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # people-facing: one line; -v shows the traceback
        progress.close()
        if args.verbose:
            raise
        print(f"error: {type(e).__name__}: {e} (-v shows the traceback)", file=sys.stderr)
        return 2
    progress.close()
    ok = write_outputs(plan, checks, print, png=not args.no_plot)
    return 0 if ok else 1
