"""verl engine comparison under tensor parallelism, one process per rank (run by tests/test_verl_plugin.py
as `python tests/verl_harness.py CKPT [sequence_parallel]` under torch.distributed.run)."""

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
        for key in ("log_probs", "entropy"):
            result[f"{fmt}_{key}"] = max((a - b).abs().max().item()
                                         for a, b in zip(rows["ours"][key].unbind(), rows["stock"][key].unbind()))
        result[f"{fmt}_grad_rel"] = max(((grads["ours"][n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
                                        for n, g in grads["stock"].items())
    from megatron.core import parallel_state

    result["rank"] = dist.get_rank()
    result["tp_size"] = parallel_state.get_tensor_model_parallel_world_size()
    return result


def grad_loss(model_output, data, dp_group=None):
    """Response log-probs weighted by the advantages plus entropy, token mean over the mini-batch."""
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = no_padding_2_padding(model_output["entropy"], data)
    padded = data.select("response_mask", "advantages").to_padded_tensor()
    mask = padded["response_mask"].bool()
    loss = (-(log_prob * padded["advantages"]) - 0.01 * entropy)[mask].sum() / data["batch_num_tokens"]
    return loss, {}


if __name__ == "__main__":
    import json

    sp = len(sys.argv) > 2 and sys.argv[2] == "sequence_parallel"
    print("RESULT " + json.dumps(engine_comparison(sys.argv[1], sequence_parallel=sp)), flush=True)
