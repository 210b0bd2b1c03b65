"""One process of the checkpoint resume tests (tests/test_checkpoint_resume.py), verl 0.9.1's engine on a CPU, fp32.

`python tests/ckpt_worker.py run ENGINE HF_CKPT SAVE_DIR OUT K DIST DISTOPT`: train K steps, save a verl
checkpoint to SAVE_DIR, train one more step (the uninterrupted run); `resume ...` (same arguments):
load SAVE_DIR into a freshly built engine and train that one step. Either way OUT gets the last step's
per-micro-batch losses, grad norm, learning rate and every parameter. ENGINE: `ours` (prefix sharing on)
or `stock` (verl's MegatronEngineWithLMHead); DIST: use_dist_checkpointing (0/1); DISTOPT: the
distributed optimizer (0/1). Environment (scripts/gpu_ckpt.sh): PS_CKPT_DTYPE (float32; bfloat16 on the
GPU), PS_CKPT_SHARING (on/off: our engine's prefix sharing, on by default)."""

from __future__ import annotations

import sys


def _engine(kind: str, hf_ckpt: str, dist: bool, distopt: bool):
    import os

    from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

    from ps_bridge.config import PrefixSharingConfig

    from ps_bridge.verl.side_by_side import build_engine, build_stock_engine

    # built from the HF checkpoint (verl's use_dist_checkpointing=True also reads the *initial* weights from
    # a dist checkpoint, `dist_checkpointing_path`); the flag is set on the checkpoint manager below
    engine_config = McoreEngineConfig(forward_only=False, use_distributed_optimizer=distopt,
                                      use_dist_checkpointing=False, override_transformer_config={})
    # no clipping (megatron clips CUDA tensors only); a warm-up and a decay: the scheduler's state matters at the resumed step
    optimizer_config = McoreOptimizerConfig(lr=1e-3, clip_grad=0.0, weight_decay=0.01, total_training_steps=10,
                                            lr_warmup_steps=2, lr_decay_style="cosine", min_lr=1e-4,
                                            use_checkpoint_opt_param_scheduler=True)  # else verl restarts it
    dtype = os.environ.get("PS_CKPT_DTYPE", "float32")
    if kind == "stock":
        engine = build_stock_engine(hf_ckpt, engine_config=engine_config, optimizer_config=optimizer_config,
                                    forward_only=False, dtype=dtype)
        # verl 0.9.1's own dist-checkpoint load with an optimizer fails on the stock engine too ("Param id 0
        # does not match any model sharded param"); the fix our engine carries (ps_bridge/checkpoint_engine.py)
        from ps_bridge.checkpoint_engine import _fresh_model_state_for_optimizer

        _fresh_model_state_for_optimizer(engine.checkpoint_mananager)
    else:
        from ps_bridge.verl.engine import PrefixSharedMegatronEngine

        engine = build_engine(PrefixSharedMegatronEngine, hf_ckpt, engine_config=engine_config,
                              optimizer_config=optimizer_config, forward_only=False, dtype=dtype)
        engine.prefix_sharing_config = PrefixSharingConfig(enabled=os.environ.get("PS_CKPT_SHARING", "on") == "on")
    engine.checkpoint_mananager.use_dist_checkpointing = dist
    return engine


def _step(engine, samples, step: int) -> dict:
    from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu
    from ps_bridge.verl.side_by_side import grpo_micro_batch
    from verl_harness import grad_loss  # tests/ is on the path: this script runs from there

    losses = []

    def loss_fn(model_output, data, dp_group=None):
        loss, metrics = grad_loss(model_output, data, dp_group)
        losses.append(float(loss.detach()))
        return loss, metrics

    batch = grpo_micro_batch(samples, micro_batch_size=4, advantages_seed=step)
    with engine_call_on_cpu(), engine.train_mode():
        out = engine.train_batch(batch, loss_fn)
        lr = engine.lr_scheduler_step()
    return {"losses": losses, "grad_norm": float(out["metrics"]["grad_norm"]), "lr": lr}


def main(mode, kind, hf_ckpt, save_dir, out, k, dist, distopt):
    import json

    import torch

    from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu
    from ps_bridge.verl.side_by_side import prepare_side_by_side

    prepare_side_by_side()
    from ps_bridge.tiny_checkpoints import grpo_like_samples

    samples = grpo_like_samples(256, num_prompts=3, n=4, seed=7, shuffle=False)
    engine = _engine(kind, hf_ckpt, bool(int(dist)), bool(int(distopt)))
    k = int(k)
    if mode == "run":
        for step in range(k):
            _step(engine, samples, step)
        # the engine's save_checkpoint is its checkpoint manager's, plus moving a CPU-resident model to
        # the GPU first (which fails without one): the manager directly
        with engine_call_on_cpu():
            engine.checkpoint_mananager.save_checkpoint(local_path=save_dir, global_step=k)
    else:
        with engine_call_on_cpu():
            engine.load_checkpoint(save_dir, del_local_after_load=False)
    result = _step(engine, samples, k)
    result["params"] = {n: p.detach().clone() for n, p in engine.module[0].named_parameters()}
    torch.save(result, out)
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "params"}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:9])
