"""verl engine comparisons, one process per rank, run by tests/test_verl_plugin.py under torch.distributed.run:
`python tests/verl_harness.py CKPT [sequence_parallel] [tree]` (tensor parallelism, against the stock engine) and
`python tests/verl_harness.py layout CKPT TP PP CP SP PER_TOKEN OUT [tree]` (our engine at that parallel layout, data
parallel over the rest of the world: rows and verl-loss gradients saved to OUT), `python tests/verl_harness.py expert_parallel CKPT EP OUT [CP] [tree]` (our engine at
expert_model_parallel_size EP and context_parallel_size CP on EP x CP ranks, data parallel size EP:
each data-parallel rank its own whole groups)."""

from __future__ import annotations

import sys

from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu


# ---- tensor parallelism: one process per rank ---------------------------------------------------


def tree_samples_for_engines(vocab: int = 256):
    """16 samples shaped like a prefix tree (`system_prompt_samples`): a system prompt of 20 tokens
    shared by 4 prompts of 3 responses each, and a 4-turn chain whose every turn's prompt holds the
    previous turn's whole sequence."""
    from ps_bridge.tools.tiny_checkpoints import system_prompt_samples

    return system_prompt_samples(vocab, system_len=20, num_prompts=4, n=3, turns=4, seed=3)


def tree_config():
    """Our engine on prefix trees sharing every common token (`PS_BRIDGE_TREE=1`, threshold 0)."""
    from ps_bridge.config import PrefixSharingConfig

    return PrefixSharingConfig(enabled=True, tree=True, tree_min_shared=0)


def tree_token_budget(samples) -> int:
    """A dynamic micro-batch budget of twice the longest sample: the tree is split over micro-batches."""
    return 2 * max(len(s.prompt) + len(s.response) for s in samples)


class LayoutDepths:
    """A logging handler keeping the tree depth of every `packed_batch_layout` line our engine logs."""

    def __init__(self):
        import logging

        self.depths = []
        self.handler = logging.Handler()
        self.handler.emit = self._emit
        self.logger = logging.getLogger("ps_bridge")

    def _emit(self, record):
        import re

        m = re.search(r"packed_batch_layout: .*?depth=(\d+)", record.getMessage())
        if m:
            self.depths.append(int(m.group(1)))

    def __enter__(self):
        import logging

        self.level = self.logger.level
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def engine_comparison(ckpt: str, tp: int = 2, sequence_parallel: bool = False, tree: bool = False) -> dict:
    """On this TP rank (under torch.distributed.run; gloo on a CPU): our engine vs the stock engine, THD and
    BSHD, for `infer_batch` rows and the local shards of the policy-loss gradients (`grad_loss`). With
    `tree`: our engine on prefix trees (`tree_samples_for_engines`, `tree_config`), THD, dynamic
    micro-batches (`tree_token_budget`: each engine forms its own); each row's last log-prob, which has
    no label (the stock engine fills it from the next sample of its own packing), is left out."""
    import torch.distributed as dist

    from ps_bridge.tools.verl_check.side_by_side import build_engine, build_stock_engine, grpo_micro_batch, prepare_side_by_side

    prepare_side_by_side()
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine

    if tree:
        samples = tree_samples_for_engines()
        batch_args, formats = dict(max_token_len=tree_token_budget(samples)), ("thd",)
    else:
        samples = grpo_like_samples(256, num_prompts=3, n=4, seed=7, shuffle=False)
        batch_args, formats = dict(micro_batch_size=4), ("thd", "bshd")
    result = {}
    for fmt in formats:
        kw = dict(use_remove_padding=fmt == "thd", forward_only=False, tp=tp, sequence_parallel=sequence_parallel)
        engines = {"stock": build_stock_engine(ckpt, **kw), "ours": build_engine(PrefixSharedMegatronEngine, ckpt, **kw)}
        if tree:
            engines["ours"].prefix_sharing_config = tree_config()
        rows, grads = {}, {}
        for name, engine in engines.items():
            with engine_call_on_cpu(), engine.eval_mode(), LayoutDepths() as logged:
                rows[name] = engine.infer_batch(grpo_micro_batch(samples, **batch_args))["model_output"]
            if name == "ours":  # our engine's micro-batches and their tree depths
                result[f"{fmt}_depths"] = logged.depths
            with engine_call_on_cpu(), engine.train_mode():
                engine.optimizer_zero_grad()
                engine.forward_backward_batch(grpo_micro_batch(samples, **batch_args), grad_loss, forward_only=False)
                grads[name] = {n: p.main_grad.detach().clone() for n, p in engine.module[0].named_parameters()}
        # from row position P - 1 on, what verl's losses read: by default our output layer skips the
        # other prompt positions of a shared micro-batch (they hold 0; PrefixSharingConfig.prompt_values)
        for key in ("log_probs", "entropy"):
            cut = -1 if tree and key == "log_probs" else None
            result[f"{fmt}_{key}"] = max((a[len(s.prompt) - 1:cut] - b[len(s.prompt) - 1:cut]).abs().max().item()
                                         for a, b, s in zip(rows["ours"][key].unbind(), rows["stock"][key].unbind(), samples))
        result[f"{fmt}_grad_rel"] = max(((grads["ours"][n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
                                        for n, g in grads["stock"].items())
    from megatron.core import parallel_state

    result["rank"] = dist.get_rank()
    result["tp_size"] = parallel_state.get_tensor_model_parallel_world_size()
    return result


# ---- a parallel layout: our engine's rows and verl-loss gradients, every DP rank its own groups ------------

# verl's loss aggregation modes the layout runs check (`actor.loss_agg_mode`)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")


def layout_run(ckpt: str, tp: int, pp: int, cp: int, sp: bool, per_token: bool, out: str, tree: bool = False) -> dict:
    """Our engine at TP `tp` x PP `pp` x CP `cp` (+ SP `sp`) on this world (data parallel over the rest),
    THD, prefix sharing on, or off on a world of one (the unshared reference). The same 16 samples
    (4 groups of 4, drawn alike on every rank) with per-sample advantages / old and ref log-probs; each
    data-parallel rank takes the whole groups `group_dp_partitions` gives it, as verl's driver splits
    a batch. Saved by every rank to `OUT.rank<r>`: its `infer_batch` log-probs / entropy (temperature
    0.7; last pipeline stage) with its sample indices, and for each of `LOSS_AGG_MODES` the HF-named
    gradients of verl's own `ppo_loss` (clip, entropy bonus, low-var KL; temperature 0.7) after
    megatron's DDP reduction (`calculate_per_token_loss=True` with `per_token`: megatron's per-token
    regime, gradients divided by the tokens summed over data-parallel-with-CP); `unreduced`: the
    token-mean gradients with megatron's `finalize_model_grads` left out (each rank's own part only).
    With `tree`: the 16 samples of `tree_samples_for_engines` (a shared system prompt, a multi-turn
    chain), our engine on prefix trees (`tree_config`; off on a world of one, the reference), dynamic
    micro-batches (`tree_token_budget`)."""
    from functools import partial

    import torch
    import torch.distributed as dist

    from ps_bridge.tools.verl_check.side_by_side import build_engine, grpo_micro_batch, prepare_side_by_side

    prepare_side_by_side()
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.parallel.gradients import hf_named_gradients
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples
    from ps_bridge.tools import verl_check as check
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine
    from ps_bridge.verl.micro_batches import group_dp_partitions

    import time

    started = time.perf_counter()
    samples = tree_samples_for_engines() if tree else grpo_like_samples(256, num_prompts=4, n=4, seed=7, shuffle=False)
    overrides = dict(calculate_per_token_loss=True) if per_token else None
    engine = build_engine(PrefixSharedMegatronEngine, ckpt, use_remove_padding=True, forward_only=False,
                          tp=tp, pp=pp, cp=cp, sequence_parallel=sp, overrides=overrides)
    shared = dist.get_world_size() > 1
    engine.prefix_sharing_config = tree_config() if tree and shared else PrefixSharingConfig(enabled=shared)
    batch_args = dict(max_token_len=tree_token_budget(samples)) if tree else dict(micro_batch_size=4)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    parts = group_dp_partitions([s.uid for s in samples], [len(s.prompt) for s in samples],
                                [len(s.prompt) + len(s.response) for s in samples], dp)
    mine = parts[dp_rank]
    whole = grpo_micro_batch(samples)  # every sample's own advantages and old log-probs

    def batch():
        td = grpo_micro_batch([samples[i] for i in mine], temperature=0.7, **batch_args)
        for key in ("advantages", "old_log_probs"):
            td[key] = whole[key][mine, : td[key].shape[1]].clone()
        td["ref_log_prob"] = td["old_log_probs"] - 0.05 * td["old_log_probs"].abs()  # a KL term that is not 0
        tu.assign_non_tensor(td, global_batch_size=len(samples))  # the mini-batch over all DP ranks, as verl's
        return td

    params = dict(engine.module[0].named_parameters())

    def gradients(mode: str) -> dict:
        """megatron's main_grad of every parameter after verl's loss in `mode` (reduced by its DDP)."""
        settings = check.CheckSettings(model=ckpt, n=4, overrides=[
            f"actor_rollout_ref.actor.loss_agg_mode={mode}", "actor_rollout_ref.actor.entropy_coeff=0.01"])
        actor_cfg, _, _ = check.role_configs(check.trainer_config(settings))
        with engine_call_on_cpu(), engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward_batch(batch(), partial(ppo_loss, config=actor_cfg), forward_only=False)
            grads = {n: p.main_grad.detach().clone() for n, p in params.items()}
            engine.optimizer_zero_grad()
        return grads

    def hf_named(grads: dict) -> dict:
        """Under HF names, whole (the export gathers over TP and PP); after every backward pass: the
        export swaps the parameters' data (a backward pass after an export left main_grad at 0)."""
        for n, p in params.items():
            p.grad = grads[n]
        out = hf_named_gradients(engine.bridge, engine.module[0])
        for p in params.values():
            p.grad = None
        return out

    built = time.perf_counter()
    with engine_call_on_cpu(), engine.eval_mode(), LayoutDepths() as logged:
        rows = engine.infer_batch(batch())
    rows = rows.get("model_output") if rows else None
    result = {"samples": mine, "depths": logged.depths, "dp_size": dp, "cp_size": parallel_state.get_context_parallel_world_size(),
              "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
              "pp_size": parallel_state.get_pipeline_model_parallel_world_size(), "rows": None,
              "prompt_lengths": [len(s.prompt) for s in samples]}
    if rows is not None:
        result["rows"] = {k: [t.clone() for t in rows[k].unbind()] for k in ("log_probs", "entropy")}
    grads = {mode: gradients(mode) for mode in LOSS_AGG_MODES}
    config = get_model_config(engine.module[0])
    finalize, config.finalize_model_grads_func = config.finalize_model_grads_func, None
    unreduced = gradients("token-mean")  # negative control
    config.finalize_model_grads_func = finalize
    result["grads"] = {mode: hf_named(g) for mode, g in grads.items()}
    result["unreduced"] = hf_named(unreduced)
    rank = dist.get_rank()
    torch.save(result, f"{out}.rank{rank}")
    seconds = {"build_s": round(built - started, 1), "passes_s": round(time.perf_counter() - built, 1)}
    return {"rank": rank, **seconds, **{k: result[k] for k in ("dp_size", "cp_size", "tp_size", "pp_size")},
            "depths": logged.depths}


# ---- expert parallelism: our engine at an EP size, each data-parallel rank its own whole groups -------


def expert_parallel_run(ckpt: str, ep: int, out: str, cp: int = 1, tree: bool = False) -> dict:
    """Our engine at `expert_model_parallel_size=ep` and `context_parallel_size=cp` on `ep * cp` ranks
    (data parallel size ep: megatron carves the EP ranks out of the data-parallel-with-CP ranks, so
    under CP the CP ranks of a data-parallel rank hold different experts; prefix sharing on on more
    than one rank, off on one: the unshared reference over the whole batch). Each data-parallel rank
    takes the whole groups `group_dp_partitions` gives it, as verl's trainer hands each DP rank its
    part (its CP ranks the same ones); `infer_batch` rows (every CP rank hands verl the full rows) and
    the policy-loss gradients (`grad_loss`, after megatron's DDP reduction) are saved by every rank to
    `OUT.rank<r>`, with the rank's sample indices and its EP rank (its local experts' global ids).
    With `tree`: the samples of `tree_samples_for_engines` and our engine on prefix trees
    (`tree_config`); the trainer's split by uid then puts the system prompt (and the chain) on both
    data-parallel ranks."""
    from functools import partial

    import torch
    import torch.distributed as dist

    from ps_bridge.tools.verl_check.side_by_side import build_engine, grpo_micro_batch, prepare_side_by_side

    prepare_side_by_side()
    from megatron.core import parallel_state

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine
    from ps_bridge.verl.micro_batches import group_dp_partitions

    samples = tree_samples_for_engines() if tree else grpo_like_samples(256, num_prompts=4, n=4, seed=7, shuffle=False)
    # megatron's allgather dispatcher, as on a CPU elsewhere: verl's default alltoall one needs CUDA streams
    # and an all-to-all that gloo lacks. megatron refuses allgather with `variable_seq_lengths`, which only
    # its pipeline schedule reads (pp = 1 here), so that flag is turned off.
    engine = build_engine(PrefixSharedMegatronEngine, ckpt, use_remove_padding=True, forward_only=False, ep=ep, cp=cp,
                          overrides=dict(moe_token_dispatcher_type="allgather", variable_seq_lengths=False))
    shared = dist.get_world_size() > 1
    engine.prefix_sharing_config = tree_config() if tree and shared else PrefixSharingConfig(enabled=shared)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    split = partial(group_dp_partitions, [s.uid for s in samples], [len(s.prompt) for s in samples],
                    [len(s.prompt) + len(s.response) for s in samples])
    parts = split(dp)
    if tree and dp == 1:
        # megatron's load-balancing loss is taken per micro-batch: the reference runs the EP=2 ranks'
        # parts one after the other, so that its micro-batches of 4 are theirs (groups of 3 and single
        # turns do not fall into micro-batches of 4 alike otherwise); rows back in sample order below
        parts = [[i for part in split(2) for i in part]]
    mine = [samples[i] for i in parts[dp_rank]]
    with engine_call_on_cpu(), engine.eval_mode(), LayoutDepths() as logged:
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
    order = parts[dp_rank]
    if dp == 1:  # the rows in sample order
        order, back = sorted(order), sorted(range(len(order)), key=order.__getitem__)
        rows = {k: [rows[k].unbind()[j] for j in back] for k in ("log_probs", "entropy")}
        mine = [samples[i] for i in order]
    else:
        rows = {k: rows[k].unbind() for k in ("log_probs", "entropy")}
    torch.save({"log_probs": [t.clone() for t in rows["log_probs"]],
                "entropy": [t.clone() for t in rows["entropy"]], "grads": grads,
                "samples": order, "ep_rank": ep_rank, "ep_size": ep_size, "dp_size": dp,
                "cp_size": parallel_state.get_context_parallel_world_size(),
                "cp_rank": parallel_state.get_context_parallel_rank(),
                "prompt_lengths": [len(s.prompt) for s in mine], "depths": logged.depths}, f"{out}.rank{rank}")
    return {"rank": rank, "ep_size": ep_size, "dp_size": dp, "cp_size": parallel_state.get_context_parallel_world_size()}


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

    if sys.argv[1] == "layout":  # layout CKPT TP PP CP SP(0/1) PER_TOKEN(0/1) OUT [tree]
        tp, pp, cp, sp, per_token = (int(a) for a in sys.argv[3:8])
        tree = sys.argv[9:] == ["tree"]
        print("RESULT " + json.dumps(layout_run(sys.argv[2], tp, pp, cp, bool(sp), bool(per_token), sys.argv[8], tree)),
              flush=True)
    elif sys.argv[1] == "expert_parallel":  # expert_parallel CKPT EP OUT [CP] [tree]
        cp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
        tree = sys.argv[6:] == ["tree"]
        print("RESULT " + json.dumps(expert_parallel_run(sys.argv[2], int(sys.argv[3]), sys.argv[4], cp=cp, tree=tree)),
              flush=True)
    else:  # CKPT [sequence_parallel] [tree]
        flags = set(sys.argv[2:])
        result = engine_comparison(sys.argv[1], sequence_parallel="sequence_parallel" in flags, tree="tree" in flags)
        print("RESULT " + json.dumps(result), flush=True)
