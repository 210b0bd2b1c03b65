"""Reads the runs of `python -m ps_bridge.tools.grpo` (verl's per-step metrics, rollout dumps and logs),
prints them side by side, judges them and draws the curves.

Pure functions over `RunData`; nothing here starts a run. What a run directory holds (written by verl's
`main_ppo` as `launch.py` configures it):
- `metrics.jsonl`: verl's file logger, one `{"step": k, "data": {metric: value}}` per step;
- `rollouts/<k>.jsonl`: verl's `trainer.rollout_data_dir` dump, one `{"input", "output", "score", ...}` per
  response of step k, with its token log-probs (`old_log_probs`, `ref_log_prob`, `rollout_log_probs`:
  `logprob_dump.py`);
- `main_ppo.log`: the driver's output with the Ray workers' lines.

The verdict's properties and their tolerances (`TOLERANCES`, `PROBS_DIFF`):
1. step 1's rollouts are identical: both runs start from the same checkpoint, and vLLM samples with the
   same seed, so any difference means different weights reached vLLM (or sampling is not reproducible);
2. while the rollouts stay identical, the policy loss and the grad norm agree within float32 noise: both
   engines compute the same float32 math in another order (a prompt once for its n responses vs n times,
   packed vs padded rows); a token's log-prob then agrees to ~1e-6 and a mean over the batch's tokens or a
   norm over all gradient entries to ~1e-6 relative, so 1e-4 relative leaves margin and still catches a
   wrong token, mask or weight (those move the loss by far more than 1e-4);
3. if a sampled token flips on float32 rounding (the weights differ by ~1e-7 after the first update, and
   vLLM's sampler may land on the other side of a boundary), the steps from there on are compared with the
   noise floor: a stock run against a stock run with another micro-batch split, whose only difference is
   float32 rounding too. The ps-bridge run's differences must stay within `FLOOR_FACTOR` times the floor's;
4. the reward curves match: the reward is a function of the response text, so with identical rollouts the
   means are equal, and where m of N responses differ they can differ by at most m/N (scores in [0, 1]);
5. the rollout-vs-actor probability difference verl reports (`training/rollout_probs_diff_*`: vLLM's
   probabilities of the sampled tokens against the actor's recomputed ones) is as small as the stock run's:
   it measures whether vLLM sampled with the weights the actor has; stale or misnamed weights raise it by
   orders of magnitude from step 2 on;
6. the ps-bridge run's log shows `[PS][prepare] PATH 6: sharing detected` from the workers, and the stock
   run's log no `[PS]` line that turns sharing on or uses ps-bridge's engine (it really ran verl's stock
   engine); where the baseline is ps-bridge's engine with `PS_BRIDGE_SHARING=off` (Qwen3.5, which verl's stock
   engine does not build on a CPU), its log shows sharing forced off and no shared micro-batch
   engine); with the prefix tree on, a layout line of depth >= 2 (the system prompt shared across prompts);
7. a run resumed from a checkpoint repeats the uninterrupted run's later steps: the same rollouts (vLLM
   seeds each request from the rollout seed and the prompt, `ps_bridge/compat/rollout_seeds.py`, so a restart
   does not change what it samples from the same weights) and the same metrics within the tolerances above;
8. response by response, the engines' token log-probs from the same weights are equal within float32 noise
   (`LOG_PROB_ATOL`): the actor's (old) log-probs at step 1, where both runs hold the checkpoint's weights, and
   the reference's at every step whose rollouts are identical (the reference never changes). The step means
   of 2. can hide an error in a few tokens that cancels or that a near-zero advantage weighs with nothing;
   this cannot. A token's log-prob computed from the same float32 weights in another summation order (a
   prompt once for its responses, a system prompt once for several prompts, packed vs padded rows) moves
   by ~1e-6 on most tokens and by up to ~1.6e-5 on a few ill-conditioned ones: on the format-fitted model
   of `make grpo`, the reference log-probs of both engines and of Hugging Face's own float32 forward
   (eager and SDPA attention) are up to 1.6e-5 from its float64 forward, and HF eager against HF SDPA up to
   1.0e-5 apart (measured). 5e-5 leaves that margin; a wrong position, mask or weight moves a log-prob by
   1e-2 or more.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

REWARD = "critic/score/mean"
PG_LOSS = "actor/pg_loss"
GRAD_NORM = "actor/grad_norm"
PROBS_DIFF_MEAN = "training/rollout_probs_diff_mean"
PROBS_DIFF_MAX = "training/rollout_probs_diff_max"

# the table's metric columns: (header, key)
COLUMNS = (("reward", REWARD), ("pg_loss", PG_LOSS), ("grad_norm", GRAD_NORM), ("|p_vllm-p_actor|", PROBS_DIFF_MEAN))
# phases shown in the time table, in the order a step runs them (verl's `timing_s/*` keys)
PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "save_checkpoint", "step")


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def allows(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.rtol * max(abs(a), abs(b)) + self.atol


# see the module docstring (2.); the reward is exact (4.)
TOLERANCES = {
    PG_LOSS: Tolerance(rtol=1e-4, atol=1e-6),
    GRAD_NORM: Tolerance(rtol=1e-4, atol=1e-6),
    REWARD: Tolerance(rtol=0.0, atol=1e-9),
}
# (5.) ps-bridge's rollout-vs-actor difference <= factor * stock's + atol, per step, for the mean and the max
PROBS_DIFF = {PROBS_DIFF_MEAN: (3.0, 1e-5), PROBS_DIFF_MAX: (3.0, 1e-4)}
# (3.) after a flipped token, the differences may reach this many times the noise floor's
FLOOR_FACTOR = 3.0
# (8.) per token, |log p| difference of the same response from the same weights
LOG_PROB_ATOL = 5e-5
OLD_LOG_PROBS, REF_LOG_PROBS = "old_log_probs", "ref_log_prob"

SHARING_DETECTED = re.compile(r"\[PS\]\[prepare\].*PATH 6: sharing detected")
SHARING_FORCED_OFF = re.compile(r"\[PS\]\[prepare\].*forced off \(PS_BRIDGE_SHARING=off\)")
SHARING_ON = re.compile(r"\[PS\]\[prepare\].*(enable_prefix_sharing=True|engine=PrefixShared\w+)")
TREE_DEPTH = re.compile(r"\[PS\]\[prepare\].*packed_batch_layout:.*\bdepth=(\d+)")


@dataclass
class RunData:
    label: str
    steps: Dict[int, Dict[str, float]]  # step -> verl's metrics
    rollouts: Dict[int, List[Tuple[str, str]]] = field(default_factory=dict)  # step -> [(prompt, response)]
    log: str = ""
    # step -> [(prompt, response, {OLD_LOG_PROBS: [...], REF_LOG_PROBS: [...]})], where the dump has them
    log_probs: Dict[int, List[Tuple[str, str, Dict[str, List[float]]]]] = field(default_factory=dict)

    def value(self, step: int, key: str) -> Optional[float]:
        v = self.steps.get(step, {}).get(key)
        return None if v is None else float(v)

    def step_numbers(self) -> List[int]:
        return sorted(self.steps)


@dataclass(frozen=True)
class Check:
    name: str
    ok: Optional[bool]  # None: not shown (the detail says why); neither passes nor fails the verdict
    detail: str


def read_metrics(path: Path) -> Dict[int, Dict[str, float]]:
    """verl's file logger lines; a later line for the same step (a resumed run) replaces the earlier one."""
    steps: Dict[int, Dict[str, float]] = {}
    if not Path(path).exists():  # a run that stopped before its first step
        return steps
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            steps[int(row["step"])] = dict(row["data"])
    return steps


def _dump(directory: Path) -> Dict[int, List[dict]]:
    """verl's rollout dump: step -> its rows."""
    out = {}
    d = Path(directory)
    if d.is_dir():
        for f in d.glob("*.jsonl"):
            if f.stem.isdigit():
                out[int(f.stem)] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def read_rollouts(directory: Path) -> Dict[int, List[Tuple[str, str]]]:
    return {k: [(r["input"], r["output"]) for r in rows] for k, rows in _dump(directory).items()}


def read_log_probs(directory: Path) -> Dict[int, List[Tuple[str, str, Dict[str, List[float]]]]]:
    """The dump's token log-probs per response (`logprob_dump.py`); steps whose dump has none are left out."""
    keys = (OLD_LOG_PROBS, REF_LOG_PROBS)
    return {k: [(r["input"], r["output"], {key: r[key] for key in keys}) for r in rows]
            for k, rows in _dump(directory).items() if rows and all(key in r for r in rows for key in keys)}


def load_run(label: str, out_dir, metrics: str = "metrics.jsonl", rollouts: str = "rollouts",
             log: str = "main_ppo.log") -> RunData:
    d = Path(out_dir)
    log_path = d / log
    return RunData(label, read_metrics(d / metrics), read_rollouts(d / rollouts),
                   log_path.read_text(errors="replace") if log_path.exists() else "", read_log_probs(d / rollouts))


# ---------------------------------------------------------------------------------------------- rollouts


def differing_responses(a: Sequence[Tuple[str, str]], b: Sequence[Tuple[str, str]]) -> int:
    """How many of a's (prompt, response) pairs have no partner in b (as multisets: the order in which
    verl dumps the responses is not part of the property)."""
    return sum((Counter(a) - Counter(b)).values()) + max(0, len(b) - len(a))


def rollout_differences(ref: RunData, other: RunData, steps: Iterable[int]) -> Dict[int, Optional[int]]:
    """step -> number of differing responses, None where either run has no dump for the step."""
    return {
        k: differing_responses(ref.rollouts[k], other.rollouts[k])
        if k in ref.rollouts and k in other.rollouts else None
        for k in steps
    }


def first_divergence(diffs: Dict[int, Optional[int]]) -> Optional[int]:
    """The first step whose rollouts differ (or are missing: then nothing after it can be called exact)."""
    for k in sorted(diffs):
        if diffs[k] != 0:
            return k
    return None


# ---------------------------------------------------------------------------------------------- checks


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x != x:
        return "nan"
    if x == 0:
        return "0"
    return f"{x:.3e}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.4f}"


def _missing(runs: Sequence[RunData], steps: Sequence[int], keys: Sequence[str]) -> List[str]:
    return [f"{r.label} step {k}: {key}" for r in runs for k in steps for key in keys if r.value(k, key) is None]


def compare_runs(ref: RunData, other: RunData, floor: Optional[RunData] = None,
                 steps: Optional[Sequence[int]] = None, name: str = "") -> List[Check]:
    """Properties 1-5 of `other` against `ref` (ref: verl's stock engine); `floor`: ref's engine with another
    micro-batch split, the float32 noise floor for steps after a flipped token."""
    tag = f"{name}: " if name else ""
    steps = list(steps) if steps is not None else ref.step_numbers()
    checks: List[Check] = []
    if not steps:
        return [Check(f"{tag}steps", False, f"{ref.label} logged no step")]
    missing_steps = [k for k in steps if k not in other.steps]
    if missing_steps:
        checks.append(Check(f"{tag}steps", False, f"{other.label} logged no metrics for steps {missing_steps}"))
        steps = [k for k in steps if k in other.steps]
        if not steps:
            return checks
    absent = _missing((ref, other), steps, (REWARD, PG_LOSS, GRAD_NORM))
    if absent:
        checks.append(Check(f"{tag}metrics", False, "missing: " + ", ".join(absent[:6])))
        return checks

    diffs = rollout_differences(ref, other, steps)
    first = steps[0]
    if diffs[first] is None:
        checks.append(Check(f"{tag}step {first} rollouts identical", False,
                            f"no rollout dump for step {first} (trainer.rollout_data_dir)"))
    else:
        n = len(ref.rollouts[first])
        checks.append(Check(f"{tag}step {first} rollouts identical", diffs[first] == 0 and n > 0,
                            f"{diffs[first]} of {n} responses differ"))
    flip = first_divergence(diffs)
    exact = [k for k in steps if flip is None or k < flip]
    after = [k for k in steps if flip is not None and k >= flip]
    if flip is None:
        checks.append(Check(f"{tag}rollouts of every step identical", True, f"steps {steps[0]}-{steps[-1]}"))
    elif flip != first:
        checks.append(Check(f"{tag}rollouts of every step identical", True,
                            f"steps {steps[0]}-{flip - 1} identical, step {flip} "
                            + ("has no rollout dump" if diffs[flip] is None else f"differs in {diffs[flip]} responses")
                            + ": from there the runs are judged against the noise floor"))
    # (2.) exact phase
    for key in (PG_LOSS, GRAD_NORM):
        tol = TOLERANCES[key]
        bad = [k for k in exact if not tol.allows(ref.value(k, key), other.value(k, key))]
        worst = max((_rel(ref.value(k, key), other.value(k, key)) for k in exact), default=None)
        if exact:
            checks.append(Check(
                f"{tag}{key} equal while rollouts are identical", not bad,
                f"steps {exact[0]}-{exact[-1]}: max relative difference {_fmt(worst)} "
                f"(tolerance rtol {tol.rtol:g} + atol {tol.atol:g})" + (f"; outside at steps {bad}" if bad else "")))

    # (3.) after a flipped token: against the floor
    if after and flip != first:
        checks += _against_floor(ref, other, floor, after, tag)

    # (4.) rewards
    bad = []
    for k in steps:
        d = diffs[k]
        n = len(ref.rollouts.get(k, ())) or None
        bound = 0.0 if d == 0 else (d / n if d is not None and n else None)
        delta = abs(ref.value(k, REWARD) - other.value(k, REWARD))
        if bound is None or delta > bound + TOLERANCES[REWARD].atol:
            bad.append(f"step {k}: |diff| {delta:.4g} > {('?' if bound is None else f'{bound:.4g}')}")
    checks.append(Check(f"{tag}reward curves match", not bad,
                        "; ".join(bad) if bad else "equal where the rollouts are; within (differing responses)/N else"))

    # (5.) rollout vs actor
    for key, (factor, atol) in PROBS_DIFF.items():
        rows = [(k, ref.value(k, key), other.value(k, key)) for k in steps]
        rows = [(k, a, b) for k, a, b in rows if a is not None and b is not None and a == a and b == b]
        if not rows:
            checks.append(Check(f"{tag}{key} as small as {ref.label}'s", False,
                                f"not logged (rollout.calculate_log_probs=True makes verl log it)"))
            continue
        bad = [f"step {k}: {_fmt(b)} vs {_fmt(a)}" for k, a, b in rows if b > factor * a + atol]
        worst = max(rows, key=lambda r: r[2])
        checks.append(Check(
            f"{tag}{key} as small as {ref.label}'s", not bad,
            (f"; ".join(bad) if bad else f"max {_fmt(worst[2])} (step {worst[0]}) vs {ref.label}'s {_fmt(worst[1])}")
            + f" (allowed: {factor:g} x {ref.label}'s + {atol:g})"))
    return checks


def _rel(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def _against_floor(ref: RunData, other: RunData, floor: Optional[RunData], after: List[int], tag: str) -> List[Check]:
    if floor is None:
        return [Check(f"{tag}steps {after[0]}-{after[-1]} (after a flipped token) within the noise floor", False,
                      "the noise-floor run was not run (--noise-floor)")]
    floor_steps = [k for k in ref.step_numbers() if k in floor.steps]
    floor_flip = first_divergence(rollout_differences(ref, floor, floor_steps))
    checks = []
    for key in (PG_LOSS, GRAD_NORM, REWARD):
        floor_delta = [abs(ref.value(k, key) - floor.value(k, key)) for k in floor_steps
                       if floor_flip is not None and k >= floor_flip and floor.value(k, key) is not None]
        if not floor_delta:
            checks.append(Check(
                f"{tag}{key} after the flip within the noise floor", False,
                f"inconclusive: the rollouts differ from step {after[0]}, but the noise-floor run's never did, so "
                "it gives no size for a flip's effect; run again with another --seed"))
            continue
        limit = FLOOR_FACTOR * max(floor_delta)
        bad = [k for k in after if abs(ref.value(k, key) - other.value(k, key)) > max(limit, TOLERANCES[key].atol)]
        checks.append(Check(
            f"{tag}{key} after the flip within the noise floor", not bad,
            f"steps {after[0]}-{after[-1]}: max |diff| "
            f"{_fmt(max(abs(ref.value(k, key) - other.value(k, key)) for k in after))}, floor max {_fmt(max(floor_delta))}"
            f" (allowed {FLOOR_FACTOR:g} x floor)" + (f"; outside at steps {bad}" if bad else "")))
    return checks


def _log_prob_difference(ref: RunData, other: RunData, step: int, key: str) -> Tuple[float, int]:
    """The largest per-token |difference| of `key` over the step's responses, matched by (prompt, response)
    (identical responses of a prompt pair up in dump order), and the number of tokens compared; inf where a
    response has no partner or another length."""
    partners: Dict[Tuple[str, str], List[List[float]]] = {}
    for prompt, response, values in other.log_probs[step]:
        partners.setdefault((prompt, response), []).append(values[key])
    worst, tokens = 0.0, 0
    for prompt, response, values in ref.log_probs[step]:
        mates = partners.get((prompt, response))
        if not mates or len(mates[0]) != len(values[key]):
            return math.inf, tokens
        mate = mates.pop(0)
        worst = max([worst] + [abs(a - b) for a, b in zip(values[key], mate)])
        tokens += len(mate)
    return worst, tokens


def compare_log_probs(ref: RunData, other: RunData, name: str = "") -> List[Check]:
    """Property 8: old log-probs at the first step, ref log-probs at every step whose rollouts are identical."""
    tag = f"{name}: " if name else ""
    steps = [k for k in ref.step_numbers() if k in other.steps]
    if not steps:
        return [Check(f"{tag}token log-probs equal", False, "no common step")]
    diffs = rollout_differences(ref, other, steps)
    flip = first_divergence(diffs)
    exact = [k for k in steps if flip is None or k < flip]
    missing = [f"{r.label} step {k}" for r in (ref, other) for k in exact if k not in r.log_probs]
    if not exact or missing:
        return [Check(f"{tag}token log-probs equal", False,
                      "step 1's rollouts differ" if not exact else
                      "no log-probs in the rollout dump of " + ", ".join(missing[:4]) +
                      " (ps_bridge.tools.grpo.logprob_dump)")]
    checks = []
    for key, judged, what in ((OLD_LOG_PROBS, exact[:1], "the actor's (old) log-probs"),
                              (REF_LOG_PROBS, exact, "the reference's log-probs")):
        rows = [(k, *_log_prob_difference(ref, other, k, key)) for k in judged]
        worst = max(rows, key=lambda r: r[1])
        bad = [k for k, d, _ in rows if not d <= LOG_PROB_ATOL]
        span = f"step {judged[0]}" if len(judged) == 1 else f"steps {judged[0]}-{judged[-1]}"
        checks.append(Check(
            f"{tag}{key} equal per token ({what})", not bad,
            f"{span}, {sum(r[2] for r in rows)} tokens: max |diff| {_fmt(worst[1])} (step {worst[0]}; "
            f"tolerance {LOG_PROB_ATOL:g})" + (f"; outside at steps {bad}" if bad else "")))
    return checks


def check_logs(stock: RunData, ps: RunData, tree: bool = False, name: str = "",
               baseline_sharing_off: bool = False) -> List[Check]:
    """Property 6. `baseline_sharing_off`: `stock` is ps-bridge's engine with PS_BRIDGE_SHARING=off."""
    tag = f"{name}: " if name else ""
    detected = len(SHARING_DETECTED.findall(ps.log))
    checks = [
        Check(f"{tag}{ps.label} log shows sharing", detected > 0,
              f"{detected} '[PS][prepare] PATH 6: sharing detected' lines"),
        _sharing_off_check(stock, tag) if baseline_sharing_off else _stock_check(stock, tag),
    ]
    if tree:
        depths = [int(d) for d in TREE_DEPTH.findall(ps.log)]
        checks.append(Check(f"{tag}{ps.label} shares the system prompt as a tree", bool(depths) and max(depths) >= 2,
                            f"deepest layout: depth {max(depths)}" if depths else "no packed_batch_layout line"))
    return checks


def _stock_check(stock: RunData, tag: str) -> Check:
    """The stock run may import ps_bridge.verl (the CPU path borrows a layer spec from it), which then logs its
    config, sharing off; it must never have turned sharing on or logged a shared micro-batch."""
    on = [m.group(0) for m in SHARING_ON.finditer(stock.log)]
    detected = len(SHARING_DETECTED.findall(stock.log))
    ok = not on and not detected
    return Check(f"{tag}{stock.label} ran verl's stock engine", ok,
                 "no [PS] line turns sharing on" if ok else
                 f"its log has {len(on)} lines turning sharing on and {detected} 'sharing detected' lines")


def _sharing_off_check(base: RunData, tag: str) -> Check:
    forced = len(SHARING_FORCED_OFF.findall(base.log))
    detected = len(SHARING_DETECTED.findall(base.log))
    ok = forced > 0 and not detected
    return Check(f"{tag}{base.label} ran ps-bridge's engine with sharing off", ok,
                 f"{forced} 'forced off (PS_BRIDGE_SHARING=off)' lines, {detected} 'sharing detected' lines")


def check_resume(uninterrupted: RunData, resumed: RunData, after_step: int) -> List[Check]:
    """Property 7: the resumed run's steps after `after_step` against the uninterrupted run's."""
    steps = [k for k in uninterrupted.step_numbers() if k > after_step]
    if not steps:
        return [Check("resume", False, f"the uninterrupted run has no step after {after_step}")]
    missing = [k for k in steps if k not in resumed.steps]
    if missing:
        return [Check("resume", False, f"the resumed run logged no steps {missing}")]
    diffs = rollout_differences(uninterrupted, resumed, steps)
    checks = [Check(f"resume from step {after_step}: rollouts identical", all(d == 0 for d in diffs.values()),
                    ", ".join(f"step {k}: {'no dump' if d is None else f'{d} differ'}" for k, d in diffs.items()))]
    for key in (REWARD, PG_LOSS, GRAD_NORM):
        tol = TOLERANCES[key]
        bad = [k for k in steps if not tol.allows(uninterrupted.value(k, key), resumed.value(k, key))]
        worst = max(_rel(uninterrupted.value(k, key), resumed.value(k, key)) for k in steps)
        checks.append(Check(f"resume from step {after_step}: {key} equal", not bad,
                            f"steps {steps[0]}-{steps[-1]}: max relative difference {_fmt(worst)}"
                            + (f"; outside at steps {bad}" if bad else "")))
    return checks


def passed(checks: Sequence[Check]) -> bool:
    """Every check passed or was not shown, and at least one passed."""
    return any(c.ok for c in checks) and all(c.ok is not False for c in checks)


# ---------------------------------------------------------------------------------------------- output


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], groups: Sequence[Tuple[str, int]] = ()) -> str:
    """Right-aligned columns; `groups`: (title, number of columns) spanning the header, first column excluded."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    i = 1
    for title, span in groups:  # widen a group's last column until its title fits
        widths[i + span - 1] += max(0, len(title) + 2 - (sum(widths[i: i + span]) + 2 * (span - 1)))
        i += span
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = []
    if groups:
        cells, i = [" " * widths[0]], 1
        for title, span in groups:
            width = sum(widths[i: i + span]) + 2 * (span - 1)
            cells.append(title.center(width, "-"))
            i += span
        out.append("  ".join(cells))
    return "\n".join(out + [line(header)] + [line(r) for r in rows])


def _diff(x: Optional[float]) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.1e}")


def metrics_table(runs: Sequence[RunData], steps: Optional[Sequence[int]] = None) -> str:
    """One row per step; per metric each run's value and |diff| of each later run against the first; the last
    column: how many of the step's responses differ from the first run's."""
    ref = runs[0]
    steps = list(steps) if steps is not None else ref.step_numbers()
    header, groups = ["step"], []
    for title, key in COLUMNS:
        cols = [r.label for r in runs] + ([f"|d| {r.label}" for r in runs[1:]] if key != PROBS_DIFF_MEAN else [])
        header += cols
        groups.append((f" {title} ", len(cols)))
    header.append("differ " + "/".join(r.label for r in runs[1:]))
    groups.append(("responses", 1))
    rows = []
    for k in steps:
        row = [str(k)]
        for title, key in COLUMNS:
            vals = [r.value(k, key) for r in runs]
            row += [_fmt(v) for v in vals]
            if key != PROBS_DIFF_MEAN:
                row += [_diff(None if v is None or vals[0] is None else abs(v - vals[0])) for v in vals[1:]]
        d = [rollout_differences(ref, r, [k])[k] for r in runs[1:]]
        row.append("/".join("-" if x is None else str(x) for x in d))
        rows.append(row)
    return _table(header, rows, groups)


def timing_table(runs: Sequence[RunData], steps: Optional[Sequence[int]] = None) -> str:
    """Seconds per phase and step (verl's `timing_s/*`), one column per run and phase."""
    steps = list(steps) if steps is not None else runs[0].step_numbers()
    phases = [p for p in PHASES if any(r.value(k, f"timing_s/{p}") is not None for r in runs for k in steps)]
    header = ["step"] + [r.label for p in phases for r in runs]
    rows = [[str(k)] + [_seconds(r.value(k, f"timing_s/{p}")) for p in phases for r in runs] for k in steps]
    return _table(header, rows, [(f" {p} ", len(runs)) for p in phases])


def _seconds(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_checks(checks: Sequence[Check]) -> str:
    status = {True: "PASS", False: "FAIL", None: "NOT SHOWN"}
    return "\n".join(f"  [{status[c.ok]}] {c.name}: {c.detail}" for c in checks)


def verdict_text(checks: Sequence[Check]) -> str:
    failed = sum(c.ok is False for c in checks)
    head = "VERDICT: PASS" if passed(checks) else f"VERDICT: FAIL ({failed} of {len(checks)})"
    return f"{format_checks(checks)}\n{head}"


def plot(groups: Sequence[Tuple[str, Sequence[RunData]]], path,
         suptitle: str = "verl main_ppo GRPO, the same seed: verl's stock engine and ps-bridge") -> Path:
    """One row of panels per (title, runs) group: reward, policy loss, grad norm, rollout-vs-actor difference
    and step time per step, one line per run."""
    # imported here: matplotlib is optional (the `plot` extra); only the PNG needs it
    import matplotlib

    matplotlib.use("Agg")
    # imported here: after matplotlib.use("Agg"); matplotlib is optional (the `plot` extra)
    import matplotlib.pyplot as plt

    panels = (("reward mean", REWARD, False), ("policy loss", PG_LOSS, False), ("grad norm", GRAD_NORM, False),
              ("|p_vllm - p_actor| mean", PROBS_DIFF_MEAN, True), ("step time (s)", "timing_s/step", False))
    fig, axes = plt.subplots(len(groups), len(panels), figsize=(4.2 * len(panels), 3.4 * len(groups)), squeeze=False)
    styles = ("-o", "--s", ":^", "-.v", "-x")
    for row, (title, runs) in zip(axes, groups):
        for ax, (label, key, log) in zip(row, panels):
            for r, style in zip(runs, styles):
                pts = [(k, r.value(k, key)) for k in r.step_numbers() if r.value(k, key) is not None]
                pts = [(k, v) for k, v in pts if not math.isnan(v) and (v > 0 or not log)]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=r.label, markersize=4)
            ax.set_title(f"{title}: {label}" if ax is row[0] else label, fontsize=9)
            ax.set_xlabel("step")
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
