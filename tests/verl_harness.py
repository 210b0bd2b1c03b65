"""verl engine comparisons, one process per rank, run by tests/test_verl_plugin.py under torch.distributed.run:
`python tests/verl_harness.py CKPT [sequence_parallel]` (tensor parallelism, against the stock engine) and
`python tests/verl_harness.py context_parallel CKPT CP OUT` (our engine at context_parallel_size CP: rows and
gradients saved to OUT), `python tests/verl_harness.py expert_parallel CKPT EP OUT` (our engine at
expert_model_parallel_size EP, data parallel over the same ranks: each rank its own whole groups)."""

from __future__ import annotations

import sys

from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu


# ---- tensor parallelism: one process per rank ---------------------------------------------------


def engine_comparison(ckpt: str, tp: int = 2, sequence_parallel: bool = False) -> dict:
    """On this TP rank (under torch.distributed.run; gloo on a CPU): our engine vs the stock engine, THD and
    BSHD, for `infer_batch` rows and the local shards of the policy-loss gradients (`grad_loss`)."""
    import torch.distributed as dist

    from ps_bridge.verl.side_by_side import build_engine, build_stock_engine, grpo_micro_batch, prepare_side_by_side

    prepare_side_by_side()
    from ps_bridge.tiny_checkpoints import grpo_like_samples
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine

    samples = grpo_like_samples(256, num_prompts=3, n=4, seed=7, shuffle=False)
    result = {}
    for fmt in ("thd", "bshd"):
        kw = dict(use_remove_padding=fmt == "thd", forward_only=False, tp=tp, sequence_parallel=sequence_parallel)
        engines = {"stock": build_stock_engine(ckpt, **kw), "ours": build_engine(PrefixSharedMegatronEngine, ckpt, **kw)}
        rows, grads = {}, {}
        for name, engine in engines.items():
            with engine_call_on_cpu(), engine.eval_mode():
                rows[name] = engine.infer_batch(grpo_micro_batch(samples, micro_batch_size=4))["model_output"]
            with engine_call_on_cpu(), engine.train_mode():
                engine.optimizer_zero_grad()
                engine.forward_backward_batch(grpo_micro_batch(samples, micro_batch_size=4), grad_loss, forward_only=False)
                grads[name] = {n: p.main_grad.detach().clone() for n, p in engine.module[0].named_parameters()}
        # from row position P - 1 on, what verl's losses read: by default our output layer skips the
        # other prompt positions of a shared micro-batch (they hold 0; PrefixSharingConfig.prompt_values)
        for key in ("log_probs", "entropy"):
            result[f"{fmt}_{key}"] = max((a[len(s.prompt) - 1:] - b[len(s.prompt) - 1:]).abs().max().item()
                                         for a, b, s in zip(rows["ours"][key].unbind(), rows["stock"][key].unbind(), samples))
        result[f"{fmt}_grad_rel"] = max(((grads["ours"][n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
                                        for n, g in grads["stock"].items())
    from megatron.core import parallel_state

    result["rank"] = dist.get_rank()
    result["tp_size"] = parallel_state.get_tensor_model_parallel_world_size()
    return result


# ---- context parallelism: our engine's rows and gradients at a CP size -------------------------------


def context_parallel_run(ckpt: str, cp: int, out: str) -> dict:
    """Our engine at `context_parallel_size=cp` (prefix sharing on at cp > 1, off at cp == 1: the
    unshared reference), THD: `infer_batch` rows and the policy-loss gradients (`grad_loss`), saved
    by every rank to `OUT.rank<r>`."""
    import torch
    import torch.distributed as dist

    from ps_bridge.verl.side_by_side import build_engine, grpo_micro_batch, prepare_side_by_side

    prepare_side_by_side()
    from megatron.core import parallel_state

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tiny_checkpoints import grpo_like_samples
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine

    samples = grpo_like_samples(256, num_prompts=3, n=4, seed=7, shuffle=False)
    engine = build_engine(PrefixSharedMegatronEngine, ckpt, use_remove_padding=True, forward_only=False, cp=cp)
    engine.prefix_sharing_config = PrefixSharingConfig(enabled=cp > 1)
    with engine_call_on_cpu(), engine.eval_mode():  # a temperature != 1: each shard's positions rescaled
        rows = engine.infer_batch(grpo_micro_batch(samples, micro_batch_size=4, temperature=0.7))["model_output"]
    with engine_call_on_cpu(), engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(grpo_micro_batch(samples, micro_batch_size=4), grad_loss, forward_only=False)
        grads = {n: p.main_grad.detach().clone() for n, p in engine.module[0].named_parameters()}
    rank = dist.get_rank()
    torch.save({"log_probs": [t.clone() for t in rows["log_probs"].unbind()],
                "entropy": [t.clone() for t in rows["entropy"].unbind()], "grads": grads,
                "prompt_lengths": [len(s.prompt) for s in samples]}, f"{out}.rank{rank}")
    return {"rank": rank, "cp_size": parallel_state.get_context_parallel_world_size()}


# ---- expert parallelism: our engine at an EP size, each data-parallel rank its own whole groups -------


def expert_parallel_run(ckpt: str, ep: int, out: str) -> dict:
    """Our engine at `expert_model_parallel_size=ep` on `ep` ranks (data parallel size ep; prefix
    sharing on at ep > 1, off at ep == 1: the unshared reference over the whole batch). Each rank takes
    the whole groups `group_dp_partitions` gives it, as verl's trainer hands each DP rank its part;
    `infer_batch` rows and the policy-loss gradients (`grad_loss`, after megatron's DDP reduction) are
    saved by every rank to `OUT.rank<r>`, with the rank's sample indices and its global expert ids."""
    import torch
    import torch.distributed as dist

    from ps_bridge.verl.side_by_side import build_engine, grpo_micro_batch, prepare_side_by_side

    prepare_side_by_side()
    from megatron.core import parallel_state

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tiny_checkpoints import grpo_like_samples
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine, group_dp_partitions

    samples = grpo_like_samples(256, num_prompts=4, n=4, seed=7, shuffle=False)
    # megatron's allgather dispatcher, as on a CPU elsewhere: verl's default alltoall one needs CUDA streams
    # and an all-to-all that gloo lacks. megatron refuses allgather with `variable_seq_lengths`, which only
    # its pipeline schedule reads (pp = 1 here), so that flag is turned off.
    engine = build_engine(PrefixSharedMegatronEngine, ckpt, use_remove_padding=True, forward_only=False, ep=ep,
                          overrides=dict(moe_token_dispatcher_type="allgather", variable_seq_lengths=False))
    engine.prefix_sharing_config = PrefixSharingConfig(enabled=ep > 1)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    parts = group_dp_partitions([s.uid for s in samples], [len(s.prompt) for s in samples],
                                [len(s.prompt) + len(s.response) for s in samples], dp)
    mine = [samples[i] for i in parts[dp_rank]]
    with engine_call_on_cpu(), engine.eval_mode():
        rows = engine.infer_batch(grpo_micro_batch(mine, micro_batch_size=4, temperature=0.7))["model_output"]
    # the whole batch's advantages, each sample's own row (grpo_micro_batch draws them per batch)
    advantages = grpo_micro_batch(samples, micro_batch_size=4)["advantages"]
    batch = grpo_micro_batch(mine, micro_batch_size=4)
    batch["advantages"] = advantages[parts[dp_rank], : batch["advantages"].shape[1]].clone()
    with engine_call_on_cpu(), engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(batch, grad_loss, forward_only=False)
        grads = {n: p.main_grad.detach().clone() for n, p in engine.module[0].named_parameters()}
    rank = dist.get_rank()
    ep_size, ep_rank = parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()
    torch.save({"log_probs": [t.clone() for t in rows["log_probs"].unbind()],
                "entropy": [t.clone() for t in rows["entropy"].unbind()], "grads": grads,
                "samples": parts[dp_rank], "ep_rank": ep_rank, "ep_size": ep_size, "dp_size": dp,
                "prompt_lengths": [len(s.prompt) for s in mine]}, f"{out}.rank{rank}")
    return {"rank": rank, "ep_size": ep_size, "dp_size": dp}


def grad_loss(model_output, data, dp_group=None):
    """Response log-probs weighted by the advantages plus entropy, token mean over the mini-batch
    (`batch_num_tokens`: summed over the data-parallel ranks by verl), times verl's `dp_size` as verl's
    own losses (`verl/workers/utils/losses.py`) do: megatron's DDP averages the gradients over the
    data-parallel ranks, so the reduced gradient is that of the global token mean (dp_size 1 under
    TP and CP alone)."""
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = no_padding_2_padding(model_output["entropy"], data)
    padded = data.select("response_mask", "advantages").to_padded_tensor()
    mask = padded["response_mask"].bool()
    loss = (-(log_prob * padded["advantages"]) - 0.01 * entropy)[mask].sum() / data["batch_num_tokens"] * data["dp_size"]
    return loss, {}


if __name__ == "__main__":
    import json

    if sys.argv[1] == "context_parallel":
        print("RESULT " + json.dumps(context_parallel_run(sys.argv[2], int(sys.argv[3]), sys.argv[4])), flush=True)
    elif sys.argv[1] == "expert_parallel":
        print("RESULT " + json.dumps(expert_parallel_run(sys.argv[2], int(sys.argv[3]), sys.argv[4])), flush=True)
    else:
        sp = len(sys.argv) > 2 and sys.argv[2] == "sequence_parallel"
        print("RESULT " + json.dumps(engine_comparison(sys.argv[1], sequence_parallel=sp)), flush=True)
