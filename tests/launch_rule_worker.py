"""torchrun worker of tests/test_launch_rule.py: every rank decides on the same micro-batches (as the
TP / CP / PP ranks of one data-parallel rank see them) and rank 0 writes all ranks' decisions.

    torchrun --nproc-per-node 2 tests/launch_rule_worker.py IN.json OUT.json
IN.json: {"cases": [[model cost fields, [P, R, n, groups]], ...]}."""

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from ps_bridge.bench.catalog import make_samples
from ps_bridge.config import PrefixSharingConfig
from ps_bridge.launch_rule import ModelCost, sharing_for


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # rank-dependent global state must not matter
    cases = json.load(open(sys.argv[1]))["cases"]
    decisions = []
    for cost, (P, R, n, groups) in cases:
        samples = make_samples(P, R, n, groups, 1000, 7)
        d = sharing_for(samples, PrefixSharingConfig(backend="auto"), ModelCost(**cost), "cuda", "bfloat16")
        decisions.append(dataclasses.astuple(d))
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, decisions)
    if rank == 0:
        json.dump(box, open(sys.argv[2], "w"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
