#!/usr/bin/env bash
# One GPU: where verl's trainer step with image prompts spends its time, on gpu_images.sh's shape (Qwen3.5-9B
# vision-language, 4 text layers, bf16, random weights, each prompt one random 1024x1024 image of its own:
# grid (1, 64, 64), 4,096 patch rows of 1,536 values, 1,024 merged tokens; 8 prompts x n = 8, P = 256 text
# tokens, R mean 512, mini-batch 4 prompts, token budget 8192):
#   1. verl-check-images.json: `ps-bridge verl-check --images 1`, STEPS (3) steps, per-phase seconds of both
#      engines (the first: ps-bridge's with sharing off; verl's stock Qwen3.5 model needs Transformer Engine).
#   2. profile_verl_*: tools/profile_verl_phase.py on the same shape and checkpoint, engine kinds KINDS
#      (shared), phases PHASES (old_log_prob,update): step 2 under torch's profiler (wall, GPU busy, GPU idle
#      by the host range it waited on, host seconds per timed part, top host ops), step 3 under CUDA's sync
#      debug mode and cProfile (the top Python functions by own and inner time).
# LIMIT: the whole run's seconds (default 470); verl-check at most CHECK_S (260), the profile what is left.
# Also in $OUT: run.log, versions.txt, triton-autotune.tar.gz (carry it as .whl/triton-autotune.tar.gz).
# Usage (repository root, .whl/gpusite.tar.xz from tools/build_gpu_site.sh; a checkout copied two folders
# below the one holding .whl finds it there): tools/gpu_profile_images.sh
# Smaller shapes try the commands on a CPU (about 4 minutes on 2 cores): NO_SETUP=1 MODEL=tiny-qwen3.5-vl
# IMAGE_SIZE=16x24 TEXT_LEN=12 RESPONSE_LEN=8 N=4 PROMPTS=4 MINI=2 DTYPE=float32 BUDGET=128 LIMIT=1200
# VERL_OVERRIDES=actor_rollout_ref.actor.optim.clip_grad=0.0 (megatron's gradient clipping asserts CUDA tensors).
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
log="$OUT/run.log"
if [ -z "${NO_SETUP:-}" ]; then
  GPUSITE=${GPUSITE:-.whl/gpusite.tar.xz}
  [ -f "$GPUSITE" ] || GPUSITE=../../.whl/gpusite.tar.xz
  [ -f .whl/triton-autotune.tar.gz ] || export AUTOTUNE=${AUTOTUNE:-../../.whl/triton-autotune.tar.gz}
  source tools/gpu_env.sh
  gpu_setup || exit 1
  trap save_autotune EXIT
else
  save_autotune() { :; }
fi
LIMIT=${LIMIT:-470}
CHECK_S=${CHECK_S:-260}
MODEL=${MODEL:-qwen3.5-9b-vl} IMAGE_SIZE=${IMAGE_SIZE:-1024x1024} TEXT_LEN=${TEXT_LEN:-256}
RESPONSE_LEN=${RESPONSE_LEN:-512} N=${N:-8} PROMPTS=${PROMPTS:-8} MINI=${MINI:-4} DTYPE=${DTYPE:-bfloat16}
BUDGET=${BUDGET:-8192} STEPS=${STEPS:-3} KINDS=${KINDS:-shared} PHASES=${PHASES:-old_log_prob,update}
WORKDIR=${WORKDIR:-/tmp/verl-check}
SHAPE=(--model "$MODEL" --layers 4 --system-prompt-len 0 --images 1 --image-size "$IMAGE_SIZE" --prompts "$PROMPTS" --n "$N"
       --prompt-len "$TEXT_LEN" --response-len "$RESPONSE_LEN" --dtype "$DTYPE" --workdir "$WORKDIR")
VERL=(actor_rollout_ref.actor.ppo_mini_batch_size="$MINI" actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$BUDGET"
      actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="$BUDGET"
      actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="$BUDGET" ${VERL_OVERRIDES:-})

echo "=== [$SECONDS s] verl-check with images, $STEPS steps (limit $CHECK_S s)" | tee -a "$log"
timeout -k 5 "$CHECK_S" python3 -m ps_bridge.tools.cli verl-check "${SHAPE[@]}" --no-progress --steps "$STEPS" \
  --json "$OUT/verl-check-images.json" "${VERL[@]}" >>"$log" 2>&1
echo "=== verl-check exit $? [$SECONDS s]" | tee -a "$log"
save_autotune

left=$((LIMIT - SECONDS))
echo "=== [$SECONDS s] profile of $PHASES, engines $KINDS (limit $left s)" | tee -a "$log"
if [ "$left" -ge 60 ]; then
  timeout -k 5 "$left" python3 tools/profile_verl_phase.py "${SHAPE[@]}" --kinds "$KINDS" --phase "$PHASES" \
    --python-profile --out "$OUT" "${VERL[@]}" >>"$log" 2>&1
  echo "=== profile exit $? [$SECONDS s]" | tee -a "$log"
else
  echo "=== profile skipped: $left s left" | tee -a "$log"
fi

# what to read (the run's last lines): per profiled phase where its time went, then the phase seconds
# of both engines
python3 - "$OUT" "$KINDS" "$PHASES" <<'PY'
import json, os, re, sys
out, kinds, phases = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
short = lambda path: re.sub(r"\S*/(site-packages|wt-[^/]*|ps-bridge[^/]*|\.wt/[^/]*)/", "", path)  # noqa: E731
for kind in kinds:
    for phase in phases:
        path = os.path.join(out, f"profile_verl_{kind}_{phase}.txt")
        if not os.path.exists(path):
            print(f"--- {kind} {phase}: no profile")
            continue
        text = open(path).read()
        head, _, rest = text.partition("\n\nhost: top ops by self CPU time\n")
        r = json.loads(head)
        print(f"--- {kind} {phase}: wall {r.get('wall_s', 0):.3f} s, GPU busy {r.get('gpu_busy_s', 0):.3f} s, "
              f"idle {r.get('idle_s', 0):.3f} s, host syncs {r.get('sync_count')}")
        host = sorted(r.get("host_s", {}).items(), key=lambda kv: -kv[1])[:12]
        print("  host s: " + ", ".join(f"{k} {v:.3f}" for k, v in host))
        idle = list(r.get("idle_by_host_range", {}).items())[:8]
        print("  GPU idle s, by host range: " + ", ".join(f"{k} {v[0]:.3f}" for k, v in idle))
        print("  top 15 host ops by self CPU time (self, total, calls):")
        rows = [re.split(r"\s{2,}", l.strip()) for l in rest.split("\n\nGPU: top kernels")[0].splitlines()]
        for cells in [c for c in rows if len(c) >= 7 and c[0] != "Name" and not c[0].startswith("-")][:15]:
            print(f"    {cells[0][:60]:60s} {cells[2]:>10s} {cells[4]:>10s} {cells[6]:>7s}")
        py = text.partition("\n\nPython functions (cProfile of the third step's phase)\n")[2]
        lines = [l for l in py.splitlines() if l.strip()]
        first = next((i for i, l in enumerate(lines) if "tottime" in l), None)
        if first is not None:
            print("  top 15 Python functions by own time (cProfile, step 3: ncalls tottime cumtime function):")
            for l in lines[first + 1:first + 16]:
                cells = l.split(None, 5)
                if len(cells) == 6:
                    print(f"    {cells[0]:>10s} {cells[1]:>8s} {cells[3]:>8s}  {short(cells[5])[:90]}")
PY
grep -E "^step |^ +[0-9]+  [0-9]|^speed-up|F \(|exit|Error|\] step [0-9]" "$log" | tail -16
