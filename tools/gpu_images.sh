#!/usr/bin/env bash
# One GPU: image prompts on the Qwen3.5-9B vision-language shape (4 of its 32 text layers, the vision tower
# cut in proportion: 3 of 27 layers), bf16, random weights, each prompt one random 1024x1024 image of its own
# (1,024 merged vision tokens) before its text:
#   1. bench-images.json: `ps-bridge bench --images 1`, 256 text tokens, n = 8, R = 512, shared against
#      unshared in one process (the tower once per distinct image against once per sample), warm-up 2,
#      median of 3; F counts the tower.
#   2. verl-check-images.json: `ps-bridge verl-check --images 1`, 8 prompts x n = 8 (P = 256 text tokens
#      after the image, R mean 512), 3 steps, verl's multi_modal_inputs per sample; the first engine is
#      ps-bridge's with sharing off (verl's stock Qwen3.5 model needs Transformer Engine).
#   3. bench-images-fp32.json: the row of 1 again with --fp32-reference (warm-up 1, one repeat): both bf16
#      runs against a float32 twin of the same weights (shared no farther from float32 than unshared?).
# LIMIT: the whole run's seconds (default 530); the bench row at most BENCH_S (250: fla compiles its GDN
# kernels on a fresh machine), verl-check what it leaves minus FP32_S (100).
# Also in $OUT: run.log, versions.txt, triton-autotune.tar.gz (carry it as .whl/triton-autotune.tar.gz).
# Usage (repository root, .whl/gpusite.tar.xz from tools/build_gpu_site.sh): tools/gpu_images.sh
set -uo pipefail
OUT=${OUT:-/tmp/ps-bridge-out}
mkdir -p "$OUT"
source tools/gpu_env.sh
gpu_setup || exit 1
trap save_autotune EXIT
log="$OUT/run.log"
LIMIT=${LIMIT:-530}
FP32_S=${FP32_S:-100}
# the shapes above; smaller ones (e.g. MODEL=tiny-qwen3.5-vl IMAGE_SIZE=16x24 ... BENCH_FLAGS=--smoke) try the
# script's commands on a CPU (there with VERL_OVERRIDES=actor_rollout_ref.actor.optim.clip_grad=0.0: megatron's
# gradient clipping asserts CUDA tensors)
MODEL=${MODEL:-qwen3.5-9b-vl} IMAGE_SIZE=${IMAGE_SIZE:-1024x1024} TEXT_LEN=${TEXT_LEN:-256}
RESPONSE_LEN=${RESPONSE_LEN:-512} N=${N:-8} PROMPTS=${PROMPTS:-8} MINI=${MINI:-4} DTYPE=${DTYPE:-bfloat16}
ROW=(--models "$MODEL" --layers 4 --images 1 --image-size "$IMAGE_SIZE" --grid "$TEXT_LEN,$RESPONSE_LEN,$N" ${BENCH_FLAGS:-})
# `timeout 0` would mean no limit: a step whose share of LIMIT is gone does not start
limit_or_skip() { [ "$1" -ge 30 ] || { echo "=== skipped: $1 s left" | tee -a "$log"; return 1; }; }

echo "=== [$SECONDS s] bench, image row" | tee -a "$log"
timeout -k 5 "${BENCH_S:-250}" python3 -m ps_bridge.tools.cli bench --no-progress "${ROW[@]}" --warmup 2 --repeats 3 \
  --json "$OUT/bench-images.json" >>"$log" 2>&1
echo "=== bench exit $? [$SECONDS s]" | tee -a "$log"
save_autotune

left=$((LIMIT - SECONDS - FP32_S))
echo "=== [$SECONDS s] verl-check with images (limit $left s)" | tee -a "$log"
if limit_or_skip "$left"; then
  timeout -k 5 "$left" python3 -m ps_bridge.tools.cli verl-check --model "$MODEL" --layers 4 --images 1 \
    --image-size "$IMAGE_SIZE" --no-progress --workdir /tmp/verl-check --prompts "$PROMPTS" --n "$N" \
    --prompt-len "$TEXT_LEN" --response-len "$RESPONSE_LEN" --steps 3 --dtype "$DTYPE" \
    --json "$OUT/verl-check-images.json" actor_rollout_ref.actor.ppo_mini_batch_size="$MINI" \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192 actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192 \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192 ${VERL_OVERRIDES:-} >>"$log" 2>&1
  echo "=== verl-check exit $? [$SECONDS s]" | tee -a "$log"
  save_autotune
fi

left=$((LIMIT - SECONDS))
echo "=== [$SECONDS s] bench, image row against float32 (limit $left s)" | tee -a "$log"
if limit_or_skip "$left"; then
  timeout -k 5 "$left" python3 -m ps_bridge.tools.cli bench --no-progress "${ROW[@]}" --warmup 1 --repeats 1 \
    --fp32-reference --json "$OUT/bench-images-fp32.json" >>"$log" 2>&1
  echo "=== bench fp32 exit $? [$SECONDS s]" | tee -a "$log"
fi
grep -E "^\| (tiny-)?qwen|^ +[0-9]+  [0-9]|^speed-up|F \(|exit|Error" "$log" | tail -20
