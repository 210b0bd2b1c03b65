#!/usr/bin/env bash
# The checkpoint GPU check: one GPU (an H200 here), bfloat16, the Qwen3.5-0.8B shape
# (random weights, the bench's layer count), verl 0.9.1's engine with verl's default checkpoint path (the model
# as HF safetensors through the bridge; optimizer, scheduler, RNG through dist checkpointing) and the
# non-distributed optimizer (megatron-core loads the distributed one's state only with Transformer Engine or
# Apex, neither on the image: docs/checkpoints.md), one run:
#   OUT=... tools/gpu_ckpt.sh            (repository root; docs/checkpoints.md)
# (the runs' parameters stay in /tmp/ps-ckpt, only the comparison comes back)
# 1. our engine, prefix sharing ON: 2 steps, save (model, optimizer, scheduler, RNG), a 3rd step
#                                                                           -> uninterrupted_on.pt
# 2. the same 3 steps with sharing OFF (its save unused): the sharing-on-vs-off difference of the 3rd step
#                                                                           -> uninterrupted_off.pt
# 3. a new process loads (1)'s checkpoint with sharing OFF, one step        -> resumed_off.pt
# 4. a new process loads (1)'s checkpoint with sharing ON, one step         -> resumed_on.pt
# (1) runs alone, then (2), (3) and (4) side by side: each is its own process either way
# $OUT/ckpt_check.json: the 3rd step's losses, grad norm, learning rate and largest parameter difference of
# each run against (1); $OUT/ckpt.log the workers' output. Pass: resumed_on equals (1) (up to the GPU kernels'
# run-to-run noise) and resumed_off differs from (1) no more than (2) does, which is to be within verl-check's
# stock-vs-stock noise for this shape (`ps-bridge verl-check --noise-floor`, BENCHMARKS.md).
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
log="$OUT/ckpt.log"
# unpacks the stack and installs ps-bridge (its one test is not a GPU test: nothing else runs)
timeout 180 tools/gpu_checks.sh tests/test_checkpoint_refusals.py -k mtp >"$OUT/setup.log" 2>&1
source tools/gpu_env.sh
# megatron's dist_checkpointing writer needs psutil (the optimizer and RNG always go through it); the stack's
# archive does not carry it: the image's, else a wheel placed in .whl/
if ! python3 -c "import psutil" 2>/dev/null; then
  wheel=$(ls .whl/psutil-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] && python3 -m pip install -q --no-deps --target /tmp/gpusite "$wheel" >>"$log" 2>&1
  python3 -c "import psutil" 2>/dev/null || { echo "psutil is missing (megatron's checkpoint writer needs it): put a cp312 manylinux psutil wheel in .whl/" | tee -a "$log"; exit 1; }
fi
export PS_CKPT_DTYPE=bfloat16
WORK=/tmp/ps-ckpt && rm -rf "$WORK" && mkdir -p "$WORK"
# the checkpoint of a catalogue shape, written by `ps-bridge verl-check`'s own helper
HF=$(python3 - "$WORK" 2>>"$log" <<'PY' | tail -1
import sys
from ps_bridge.tools.verl_check.config import CheckSettings
from ps_bridge.tools.verl_check.model import checkpoint_for
print(checkpoint_for(CheckSettings(model="qwen3.5-0.8b", dtype="bfloat16"), sys.argv[1]))
PY
)
[ -f "$HF/config.json" ] || { echo "no checkpoint written ($HF): see $log" | tee -a "$log"; exit 1; }
echo "=== checkpoint $HF ($(date +%T))" | tee -a "$log"
# step NAME SHARING MODE SAVE_DIR LIMIT_S: one worker process (run / resume), K=2, HF-safetensors model (DIST 0),
# the non-distributed optimizer (DISTOPT 0), its output in $WORK/NAME.log (appended to $log at the end)
step() {
  echo "=== $1: sharing $2, $3 ($(date +%T))" | tee -a "$log"
  (cd tests && PS_CKPT_SHARING=$2 timeout "$5" python3 ckpt_worker.py "$3" ours "$HF" "$WORK/$4" "$WORK/$1.pt" 2 0 0) \
    >"$WORK/$1.log" 2>&1
  echo "=== $1 exit $? ($(date +%T))" >>"$WORK/$1.log"
}
# (1) alone: it autotunes fla's GDN kernels where the cache lacks them, and only its autotune results are
# kept (`save_autotune`: results found with other processes on the GPU could be slower configs); then, once
# its checkpoint is written, (2), (3) and (4) side by side (three independent processes of a 0.8B model; nothing
# here is timed; each resume is a new process)
side_by_side() {  # side_by_side NAME SHARING MODE SAVE_DIR LIMIT_S [NAME ...]: those steps at once
  local pids=()
  while [ $# -ge 5 ]; do
    step "$1" "$2" "$3" "$4" "$5" &
    pids+=($!)
    shift 5
  done
  wait "${pids[@]}"
}
step uninterrupted_on on run saved 300
save_autotune
side_by_side uninterrupted_off off run unused 300   resumed_off off resume saved 300   resumed_on on resume saved 300
cat "$WORK/uninterrupted_on.log" "$WORK/uninterrupted_off.log" "$WORK/resumed_off.log" "$WORK/resumed_on.log" >>"$log"
grep -h "^=== .* exit" "$WORK"/*.log | tee -a "$log"
python3 - "$OUT" "$WORK" <<'PY' 2>&1 | tee -a "$log"
import json, os, sys
import torch
out, work = sys.argv[1:3]
names = ("uninterrupted_on", "uninterrupted_off", "resumed_off", "resumed_on")
runs = {n: torch.load(f"{work}/{n}.pt") for n in names if os.path.exists(f"{work}/{n}.pt")}
missing = [n for n in names if n not in runs]
ref = runs.get("uninterrupted_on")
report = {"missing": missing}
for name, r in runs.items():
    report[name] = {
        "losses": r["losses"], "grad_norm": r["grad_norm"], "lr": r["lr"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])),
        "grad_norm_diff": abs(r["grad_norm"] - ref["grad_norm"]),
        "max_param_diff": max((p.float() - ref["params"][k].float()).abs().max().item() for k, p in r["params"].items()),
    }
json.dump(report, open(f"{out}/ckpt_check.json", "w"), indent=1)
print(json.dumps(report, indent=1))
sys.exit(1 if missing else 0)
PY
