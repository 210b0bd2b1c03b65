#!/usr/bin/env bash
# Multimodal GRPO, n=8, a Qwen3.5 ConditionalGeneration checkpoint on geometry problems with images
# (verl's examples/data_preprocess/geo3k.py parquet files) on GPU with ps-bridge prefix sharing: each
# group's prompt and its image run once, the vision tower once per distinct image of a micro-batch
# (docs/how-it-works.md, "Images"). Not run here: the CPU tests cover one rank through verl's engine
# (tests/test_verl_engine_images.py) and verl's trainer step with image prompts against sharing off
# (tests/test_verl_check_images.py; `ps-bridge verl-check --images 1` on a GPU); no GPU run of this script has been made.
set -euo pipefail
export MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3.5-0.8B}
export PS_PROVIDER=qwen3.5
export DEVICE=cuda
export TRAIN_FILES=${TRAIN_FILES:-$HOME/data/geo3k/train.parquet}
export VAL_FILES=${VAL_FILES:-$HOME/data/geo3k/test.parquet}
# an image of ~1,000 merged vision tokens plus the question
export MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-2048}
exec "$(dirname "$0")/grpo_prefix_sharing.sh" data.image_key=images "$@"
