"""One process (or one rank under torch.distributed.run, gloo) of the checkpoint resume tests
(tests/test_checkpoint_resume.py, tests/test_checkpoint_parallel.py), verl 0.9.1's engine on a CPU, fp32.

`python tests/ckpt_worker.py run ENGINE HF_CKPT SAVE_DIR OUT K DIST DISTOPT [LAYOUT]`: train K steps, save a
verl checkpoint to SAVE_DIR, train one more step (the uninterrupted run); `resume ...` (same arguments):
load SAVE_DIR into a freshly built engine and train that one step; `refuse ...` (SAVE_DIR: damaged
checkpoints, comma-separated): the engine's load of each, its error to OUT as JSON. Either way OUT (OUT.rank<r> under
torch.distributed.run) gets the last step's per-micro-batch losses (last pipeline stage), grad norm,
learning rate, the RNG states after the save / the load (`rng`), this rank's parameters after the step (`params`)
and when saved / just loaded (`at_checkpoint`) and, on more than one rank, the whole model under HF names
(Megatron-Bridge's export: gathered over TP / PP / EP, comparable across layouts: `hf`; `run`: `saved_hf`, the
model the checkpoint holds). ENGINE: `ours` (prefix sharing on), `stock`
(verl's MegatronEngineWithLMHead on Megatron-Bridge's stock provider) or `sequential` (ours with
megatron's own SequentialMLP experts in place of our grouped ones: the stock expert module); DIST:
use_dist_checkpointing (0/1); DISTOPT: the distributed optimizer (0/1); LAYOUT: e.g. `tp2sp`, `pp2`,
`cp2`, `ep2` (one rank when absent). Environment (tools/gpu_ckpt.sh): PS_CKPT_DTYPE (float32;
bfloat16 on the GPU), PS_CKPT_SHARING (on/off: our engine's prefix sharing, on by default),
PS_CKPT_FULLY_RESHARDABLE (1: the distributed optimizer's fully reshardable checkpoint format),
PS_CKPT_LOAD_CONTENTS (e.g. `model,optimizer`: verl's `checkpoint.load_contents`)."""

from __future__ import annotations

import re
import sys


def parse_layout(text: str) -> dict:
    """`tp2sp`, `pp2`, `pp2f2l1` (uneven: 2 layers on the first stage, 1 on the last), `cp2`, `ep2` ... ->
    McoreEngineConfig's parallel sizes (the uneven stages under `stages`)."""
    sizes = {k: int(v) for k, v in re.findall(r"(tp|pp|cp|ep|f|l)(\d+)", text or "")}
    return dict(tensor_model_parallel_size=sizes.get("tp", 1), pipeline_model_parallel_size=sizes.get("pp", 1),
                context_parallel_size=sizes.get("cp", 1), expert_model_parallel_size=sizes.get("ep", 1),
                sequence_parallel="sp" in (text or ""), stages=(sizes.get("f"), sizes.get("l")))


def _engine(kind: str, hf_ckpt: str, dist: bool, distopt: bool, layout: dict):
    import os

    from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.verl_check.side_by_side import build_engine, build_stock_engine

    layout = dict(layout)
    first, last = layout.pop("stages")
    overrides = {} if first is None else dict(num_layers_in_first_pipeline_stage=first,
                                              num_layers_in_last_pipeline_stage=last)
    if layout["expert_model_parallel_size"] > 1:
        # megatron's allgather dispatcher: verl's default alltoall one needs an all-to-all that gloo lacks;
        # megatron refuses it with `variable_seq_lengths`, which only its pipeline schedule reads (PP = 1 here)
        overrides.update(moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
    # built from the HF checkpoint (verl's use_dist_checkpointing=True also reads the *initial* weights from
    # a dist checkpoint, `dist_checkpointing_path`); the flag is set on the checkpoint manager below
    engine_config = McoreEngineConfig(forward_only=False, use_distributed_optimizer=distopt,
                                      use_dist_checkpointing=False, override_transformer_config=overrides,
                                      vanilla_mbridge=False,  # (verl 0.8.0's default is True)
                                      dist_ckpt_optim_fully_reshardable=os.environ.get("PS_CKPT_FULLY_RESHARDABLE") == "1",
                                      **layout)
    # no clipping (megatron clips CUDA tensors only); a warm-up and a decay: the scheduler's state matters at the resumed step
    optimizer_config = McoreOptimizerConfig(lr=1e-3, clip_grad=0.0, weight_decay=0.01, total_training_steps=10,
                                            lr_warmup_steps=2, lr_decay_style="cosine", min_lr=1e-4,
                                            use_checkpoint_opt_param_scheduler=True)  # else verl restarts it
    dtype = os.environ.get("PS_CKPT_DTYPE", "float32")
    if kind == "stock":
        engine = build_stock_engine(hf_ckpt, engine_config=engine_config, optimizer_config=optimizer_config,
                                    forward_only=False, dtype=dtype)
        # verl 0.9.1's own dist-checkpoint load with an optimizer fails on the stock engine too ("Param id 0
        # does not match any model sharded param"), its HF save needs modelopt: the fixes our engine carries
        # (ps_bridge/checkpoint_engine.py)
        from ps_bridge.checkpoint_engine import fix_checkpoint_manager

        fix_checkpoint_manager(engine.checkpoint_mananager)
    else:
        from ps_bridge.verl.engine import PrefixSharedMegatronEngine

        if kind == "sequential":
            _with_sequential_mlp_experts()
        engine = build_engine(PrefixSharedMegatronEngine, hf_ckpt, engine_config=engine_config,
                              optimizer_config=optimizer_config, forward_only=False, dtype=dtype)
        engine.prefix_sharing_config = PrefixSharingConfig(enabled=os.environ.get("PS_CKPT_SHARING", "on") == "on")
    engine.checkpoint_mananager.use_dist_checkpointing = dist
    if hasattr(engine.checkpoint_mananager, "use_hf_checkpoint"):  # verl 0.8.0 reads this one too
        engine.checkpoint_mananager.use_hf_checkpoint = not dist
    if os.environ.get("PS_CKPT_LOAD_CONTENTS"):  # verl's actor.checkpoint.load_contents
        engine.checkpoint_mananager.checkpoint_load_contents = os.environ["PS_CKPT_LOAD_CONTENTS"].split(",")
    return engine


def _with_sequential_mlp_experts():
    import ps_bridge.providers.qwen35 as qwen35

    grouped = qwen35.make_prefix_shared

    def make_prefix_shared(provider, gdn_backend):
        grouped(provider, gdn_backend)
        provider.moe_grouped_gemm = False

    qwen35.make_prefix_shared = make_prefix_shared


def _my_samples(samples):
    """This data-parallel rank's whole groups (as verl's trainer splits a batch), all of them on one."""
    from megatron.core import parallel_state

    from ps_bridge.verl.micro_batches import group_dp_partitions

    dp = parallel_state.get_data_parallel_world_size()
    parts = group_dp_partitions([s.uid for s in samples], [len(s.prompt) for s in samples],
                                [len(s.prompt) + len(s.response) for s in samples], dp)
    return [samples[i] for i in parts[parallel_state.get_data_parallel_rank()]]


def _step(engine, samples, step: int) -> dict:
    from verl.utils import tensordict_utils as tu

    from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu
    from ps_bridge.tools.verl_check.side_by_side import grpo_micro_batch
    from verl_harness import grad_loss  # tests/ is on the path: this script runs from there

    losses = []

    def loss_fn(model_output, data, dp_group=None):
        loss, metrics = grad_loss(model_output, data, dp_group)
        losses.append(float(loss.detach()))
        return loss, metrics

    batch = grpo_micro_batch(_my_samples(samples), micro_batch_size=4, advantages_seed=step)
    tu.assign_non_tensor(batch, global_batch_size=len(samples))  # the mini-batch over all DP ranks, as verl's
    with engine_call_on_cpu(), engine.train_mode():
        out = engine.train_batch(batch, loss_fn)
        lr = engine.lr_scheduler_step()
    grad_norm = (out or {}).get("metrics", {}).get("grad_norm")  # (verl reports it on the ranks that output rows only)
    return {"losses": losses, "grad_norm": None if grad_norm is None else float(grad_norm), "lr": lr}


def main(mode, kind, hf_ckpt, save_dir, out, k, dist, distopt, layout=""):
    import json

    import torch
    import torch.distributed as torch_dist

    from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu
    from ps_bridge.tools.verl_check.side_by_side import prepare_side_by_side

    prepare_side_by_side()
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

    engine = _engine(kind, hf_ckpt, bool(int(dist)), bool(int(distopt)), parse_layout(layout))
    if mode == "refuse":
        return _refusals(engine, save_dir.split(","), out)
    from megatron.core import parallel_state

    # data-parallel ranks (EP=2) take two groups each: the same number of micro-batches on every rank (the
    # experts' collectives run per micro-batch)
    dp = parallel_state.get_data_parallel_world_size()
    samples = grpo_like_samples(256, num_prompts=3 if dp == 1 else 2 * dp, n=4, seed=7, shuffle=False)
    # ids folded into a smaller vocabulary (the tiny Qwen3 checkpoints' 251), the lengths unchanged
    from transformers import AutoConfig

    from ps_bridge.tools.tiny_checkpoints import fold_into_vocabulary

    samples = fold_into_vocabulary(samples, AutoConfig.from_pretrained(hf_ckpt).vocab_size)
    k = int(k)
    if mode == "run":
        for step in range(k):
            _step(engine, samples, step)
        # the engine's save_checkpoint is its checkpoint manager's, plus moving a CPU-resident model to
        # the GPU first (which fails without one): the manager directly
        with engine_call_on_cpu():
            engine.checkpoint_mananager.save_checkpoint(local_path=save_dir, global_step=k)
        rng = _rng_states()  # what verl's extra/ holds
    else:
        _scramble_rng()  # so that only the load can give back the saved states
        with engine_call_on_cpu():
            engine.load_checkpoint(save_dir, del_local_after_load=False)
        rng = _rng_states()
    at_checkpoint = {n: p.detach().clone() for n, p in engine.module[0].named_parameters()}  # saved / loaded
    rank = torch_dist.get_rank() if torch_dist.is_initialized() and torch_dist.get_world_size() > 1 else None
    # (our bridge's mapping exports grouped experts, not SequentialMLP)
    whole_model = rank is not None and kind != "sequential"
    saved_hf = _hf_weights(engine) if whole_model and mode == "run" else None  # what the checkpoint holds
    result = _step(engine, samples, k)
    result["rng"], result["at_checkpoint"] = rng, at_checkpoint
    result["params"] = {n: p.detach().clone() for n, p in engine.module[0].named_parameters()}
    if whole_model:
        result["hf"], result["saved_hf"] = _hf_weights(engine), saved_hf
    torch.save(result, out if rank is None else f"{out}.rank{rank}")
    print("RESULT " + json.dumps({"rank": rank or 0, **{k: v for k, v in result.items() if k not in ("params", "hf", "saved_hf", "rng", "at_checkpoint")}}),
          flush=True)


def _refusals(engine, save_dirs, out) -> None:
    """`refuse` mode: the engine's load_checkpoint of each (damaged) checkpoint in turn, in one process (the
    checks run before verl's load reads anything): OUT gets, per directory, the exception's type, its
    message and whether it carries a chained exception (a second traceback under it)."""
    import json

    from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu

    seen = []
    for save_dir in save_dirs:
        try:
            with engine_call_on_cpu():
                engine.load_checkpoint(save_dir, del_local_after_load=False)
            seen.append(None)
        except Exception as err:  # noqa: BLE001 - what the user would see is recorded
            seen.append({"type": type(err).__name__, "message": str(err),
                         "chained": err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__)})
    with open(out, "w") as f:
        json.dump(seen, f)
    print("RESULT " + json.dumps(seen), flush=True)


def _rng_states() -> dict:
    """The RNG states verl's checkpoint saves (python, numpy, torch, megatron's tracker; the CUDA one is the
    CPU one here), as plain Python values."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    np_state = np.random.get_state()
    return {"random": random.getstate(), "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
            "torch": torch.get_rng_state().tolist(), "tracker": {k: v.tolist() for k, v in sorted(tracker.items())}}


def _scramble_rng() -> None:
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.seed(12345)
    np.random.seed(12345)
    if not torch.cuda.is_available():  # megatron's tracker holds CPU generator states here (CUDA ones on a GPU)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.set_states({k: torch.manual_seed(54321 + i).get_state() for i, k in enumerate(sorted(tracker.get_states()))})
    torch.manual_seed(12345)


def _hf_weights(engine) -> dict:
    """The whole model under HF names: Megatron-Bridge's export, gathered over TP / PP / EP (every rank calls)."""
    from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu

    with engine_call_on_cpu():
        return {n: t.detach().clone() for n, t in engine.bridge.export_hf_weights(engine.module, cpu=True, show_progress=False)}


if __name__ == "__main__":
    main(*sys.argv[1:])
