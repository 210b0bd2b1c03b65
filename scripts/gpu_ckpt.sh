#!/usr/bin/env bash
# The checkpoint GPU check (issue 20; not run yet): one H200 (machine kind nvidia-h200), bfloat16, the
# Qwen3.5-0.8B shape (random weights, the bench's layer count), verl 0.9.1's engine, a few minutes:
#   OUT=... scripts/gpu_ckpt.sh
# 1. our engine, prefix sharing ON: 2 steps, save (use_dist_checkpointing=True: model, optimizer,
#    scheduler, RNG), a 3rd step                                            -> $OUT/uninterrupted_on.pt
# 2. the same 3 steps with sharing OFF, no save: the sharing-on-vs-off difference of the 3rd step
#                                                                           -> $OUT/uninterrupted_off.pt
# 3. a new process loads the checkpoint with sharing OFF, one step          -> $OUT/resumed_off.pt
# 4. a new process loads the checkpoint with sharing ON, one step           -> $OUT/resumed_on.pt
# $OUT/ckpt_check.json: the 3rd step's loss, grad norm and largest parameter difference of each run against
# (1). Pass: resumed_on equals (1) and resumed_off is within (2)'s difference, which is to be within
# verl-check's stock-vs-stock noise for this shape (BENCHMARKS.md; `ps-bridge verl-check --noise-floor`).
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
timeout 120 scripts/gpu_checks.sh tests/test_checkpoint_refusals.py -k mtp  # unpacks and installs the stack
source scripts/gpu_env.sh
log="$OUT/ckpt.log"
export PS_CKPT_DTYPE=bfloat16
WORK=/tmp/ps-ckpt && rm -rf "$WORK" && mkdir -p "$WORK"
HF=$(python3 -c "
from ps_bridge.verl.check import CheckSettings, checkpoint_for
print(checkpoint_for(CheckSettings(model='qwen3.5-0.8b', dtype='bfloat16'), '$WORK'))" 2>>"$log" | tail -1)
echo "=== checkpoint $HF ($(date +%T))" | tee -a "$log"
step() {  # step NAME SHARING MODE: one worker process (run / resume), K=2, use_dist_checkpointing=1
  echo "=== $1: sharing $2, $3 ($(date +%T))" | tee -a "$log"
  (cd tests && PS_CKPT_SHARING=$2 timeout 240 python3 ckpt_worker.py "$3" ours "$HF" "$WORK/ckpt_$4" "$OUT/$1.pt" 2 1 0) \
    >>"$log" 2>&1
  echo "=== exit $?" | tee -a "$log"
}
step uninterrupted_on on run saved
step uninterrupted_off off run unused
step resumed_off off resume saved
step resumed_on on resume saved
python3 - "$OUT" <<'PY' | tee -a "$log"
import json, sys, torch
out = sys.argv[1]
runs = {n: torch.load(f"{out}/{n}.pt") for n in ("uninterrupted_on", "uninterrupted_off", "resumed_off", "resumed_on")}
ref = runs["uninterrupted_on"]
report = {}
for name, r in runs.items():
    report[name] = {
        "losses": r["losses"], "grad_norm": r["grad_norm"], "lr": r["lr"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])),
        "grad_norm_diff": abs(r["grad_norm"] - ref["grad_norm"]),
        "max_param_diff": max((p.float() - ref["params"][k].float()).abs().max().item() for k, p in r["params"].items()),
    }
json.dump(report, open(f"{out}/ckpt_check.json", "w"), indent=1)
print(json.dumps(report, indent=1))
PY
