#!/usr/bin/env bash
# GRPO with verl 0.9.1 (Megatron engine) and ps-bridge prefix sharing. Called by the per-model,
# per-device wrappers next to this file; every setting can be overridden from the environment and
# extra Hydra overrides can be appended on the command line.
#
#   MODEL_PATH   HF checkpoint (Qwen/Qwen2.5-0.5B-Instruct, Qwen/Qwen3.5-0.8B, Qwen/Qwen3-8B, or a local path)
#   PS_PROVIDER  ps-bridge provider name (qwen2.5 | qwen3.5 | qwen3.5-moe | qwen3 | qwen3-moe | llama3)
#   DEVICE       cuda | npu
#   TRAIN_FILES / VAL_FILES  verl parquet files (e.g. from examples/data_preprocess/gsm8k.py)
set -euo pipefail

: "${MODEL_PATH:?set MODEL_PATH}"
: "${PS_PROVIDER:?set PS_PROVIDER}"
DEVICE=${DEVICE:-cuda}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/gsm8k/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/gsm8k/test.parquet}
NNODES=${NNODES:-1}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
TP=${TP:-1}
# Sequence parallelism (verl's default; TP=1 switches it off by itself) needs the prefix-aware spec's
# sequence-parallel norms (ps_bridge.models.specs.with_sequence_parallel_norms); without them set
# SEQUENCE_PARALLEL=False for TP > 1 ("sequence parallel not supported by torch LayerNorm").
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL:-True}
PP=${PP:-1}
EP=${EP:-1}  # expert parallelism (MoE models): groups stay whole on each data-parallel rank
N_RESPONSES=${N_RESPONSES:-8}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}      # prompts per step
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-32} # prompts per mini-batch
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-1024}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-2048}
# With prefix sharing on, the *_max_token_len_per_gpu budgets count the tokens a packed micro-batch
# really holds: each group's prompt ONCE plus its responses (ps_bridge.verl.engine, prefix-aware
# micro-batches; see docs/verl.md). A budget of one whole group keeps every group whole:
# prompt + n * response. Micro-batch memory follows this packed count, so the same number is the
# same activation memory as an unshared budget of that size, with more samples in it.
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-$(( MAX_PROMPT_LEN + N_RESPONSES * MAX_RESPONSE_LEN ))}
ROLLOUT_NAME=${ROLLOUT_NAME:-vllm}
PROJECT=${PROJECT:-ps_bridge_grpo}
EXPERIMENT=${EXPERIMENT:-$(basename "$MODEL_PATH")-${DEVICE}-prefix-sharing}

# Prefix sharing is switched on by the plugin import below plus this variable. Ray workers started by
# the trainer inherit the driver's environment; on an existing Ray cluster pass them through
# +ray_kwargs.ray_init.runtime_env.env_vars.<NAME>=... as well (see docs/verl.md).
export ENABLE_PREFIX_SHARING=${ENABLE_PREFIX_SHARING:-1}
export PS_BRIDGE_PROVIDER=$PS_PROVIDER
# attention backend: the flash cascade on NVIDIA GPUs (auto), the expand design on Ascend (unverified)
if [ "${DEVICE:-cuda}" = npu ]; then DEFAULT_BACKEND=flash_atten_npu; else DEFAULT_BACKEND=auto; fi
export PS_BRIDGE_BACKEND=${PS_BRIDGE_BACKEND:-$DEFAULT_BACKEND}
# prefix trees (every common prefix once: a system prompt across prompts, multi-turn chains) are the
# default; the NPU backend (the expand design) takes one level only: PS_BRIDGE_TREE=0 there
if [ "${DEVICE:-cuda}" = npu ]; then export PS_BRIDGE_TREE=${PS_BRIDGE_TREE:-0}; fi

python3 -m verl.trainer.main_ppo --config-path=config --config-name=ppo_megatron_trainer.yaml \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$TRAIN_FILES" \
    data.val_files="$VAL_FILES" \
    data.train_batch_size="$TRAIN_BATCH_SIZE" \
    data.max_prompt_length="$MAX_PROMPT_LEN" \
    data.max_response_length="$MAX_RESPONSE_LEN" \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.external_lib=ps_bridge.verl \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.use_fused_kernels=False \
    actor_rollout_ref.actor.megatron.use_mbridge=True \
    actor_rollout_ref.actor.megatron.vanilla_mbridge=False \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$TP" \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="$PP" \
    actor_rollout_ref.actor.megatron.context_parallel_size=1 \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size="$EP" \
    actor_rollout_ref.actor.megatron.sequence_parallel="$SEQUENCE_PARALLEL" \
    actor_rollout_ref.ref.megatron.sequence_parallel="$SEQUENCE_PARALLEL" \
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size="$TP" \
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size="$PP" \
    actor_rollout_ref.ref.megatron.context_parallel_size=1 \
    actor_rollout_ref.ref.megatron.expert_model_parallel_size="$EP" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE" \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$MAX_TOKENS_PER_GPU" \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="$MAX_TOKENS_PER_GPU" \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="$MAX_TOKENS_PER_GPU" \
    actor_rollout_ref.actor.shuffle=False \
    actor_rollout_ref.actor.use_prefix_grouper=True \
    trainer.balance_batch=True \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name="$ROLLOUT_NAME" \
    actor_rollout_ref.rollout.n="$N_RESPONSES" \
    actor_rollout_ref.rollout.tensor_model_parallel_size="$TP" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    trainer.device="$DEVICE" \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name="$PROJECT" \
    trainer.experiment_name="$EXPERIMENT" \
    trainer.n_gpus_per_node="$NGPUS_PER_NODE" \
    trainer.nnodes="$NNODES" \
    trainer.save_freq=-1 \
    trainer.test_freq=10 \
    trainer.total_epochs=1 \
    "$@"
