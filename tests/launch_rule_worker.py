"""torchrun worker of tests/test_launch_rule.py: every rank decides on the same micro-batches (as the
TP / CP / PP ranks of one data-parallel rank see them) and rank 0 writes all ranks' decisions.

    torchrun --nproc-per-node 2 tests/launch_rule_worker.py IN.json OUT.json

IN.json, one of:
- {"cases": [[model cost fields, [P, R, n, groups]], ...]}: `sharing_for` on each case, no model;
- {"hf_path": ..., "tp": 2, "cp": 1, "pp": 1, "price_ns": N, "batches": [[seed, prompts, n], ...]}:
  the checkpoint loaded with that parallelism (megatron's groups over the 2 ranks), the reference
  attention on a CPU priced at N ns per layer (so the rule applies), and per micro-batch the rule's
  decision from this rank's loaded model (with and without gradients), then `schedule.logprob_pass`
  with the rule (`share=None`) and unshared (`share=False`): every rank writes its decisions, its model
  cost and the largest log-prob difference per micro-batch.
"""

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from ps_bridge.tools.bench.catalog import make_samples
from ps_bridge.config import PrefixSharingConfig
from ps_bridge.launch_rule import ModelCost, sharing_for


def rule_batches(spec):
    """The micro-batches of a parallel case, drawn from their seeds alone (every rank draws the same)."""
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

    return [grpo_like_samples(256, num_prompts=prompts, n=n, prompt_len=(4 * prompts, 6 * prompts),
                              response_len=(prompts, 2 * prompts), seed=seed, shuffle=False)
            for seed, prompts, n in spec]


def decide_cases(cases):
    decisions = []
    for cost, (P, R, n, groups) in cases:
        samples = make_samples(P, R, n, groups, 1000, 7)
        d = sharing_for(samples, PrefixSharingConfig(backend="auto"), ModelCost(**cost), "cuda", "bfloat16")
        decisions.append(dataclasses.astuple(d))
    return decisions


def decide_in_parallel(spec):
    from ps_bridge import launch_rule
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.schedule import logprob_pass

    loaded = load_model(spec["hf_path"], PrefixSharingConfig(enabled=True), tp=spec["tp"], pp=spec["pp"], cp=spec["cp"])
    table = dict(launch_rule.HOST_NS)
    for backward in (True, False):
        table[("attention", "torch_ref", "cpu", backward)] = spec["price_ns"]
    launch_rule.HOST_NS = table
    batches = rule_batches(spec["batches"])
    decisions = []
    for mb in batches:
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                d = sharing_for(mb, loaded.config, loaded.model_cost, loaded.device.type,
                                str(loaded.dtype).replace("torch.", ""))
            decisions.append(dataclasses.astuple(d))
    auto = logprob_pass(loaded, batches, share=None)
    unshared = logprob_pass(loaded, batches, share=False)
    diffs = [max(float((a - b).abs().max()) for a, b in zip(mb_a, mb_b)) for mb_a, mb_b in zip(auto, unshared)]
    return {"decisions": decisions, "cost": dataclasses.asdict(loaded.model_cost), "diffs": diffs}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # rank-dependent global state must not matter
    spec = json.load(open(sys.argv[1]))
    result = decide_cases(spec["cases"]) if "cases" in spec else decide_in_parallel(spec)
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, result)
    if rank == 0:
        json.dump(box, open(sys.argv[2], "w"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
