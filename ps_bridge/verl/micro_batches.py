"""verl's micro-batches for the prefix-shared engine: budgets in the tokens a packed micro-batch
holds, samples that share a prefix kept together.

verl forms dynamic micro-batches (`prepare_micro_batches` -> `rearrange_micro_batches`) from a token
budget that counts every sample's whole sequence. With sharing on, our engine hands the batch its
`plan.SharingPlan` (`mark_plan`: one object, the settings the forward step packs with; the budget then
counts packed tokens) and `prefix_aware_micro_batches` forms the micro-batches, in four steps:

1. **What is shared** is the plan's decision for the whole batch (`batch_plan`: the prefix tree of
   identical prompts, or the token prefix tree with `tree`; samples of different temperatures share
   nothing) and its pack order, without materializing the pack (`tree.split.packed_costs`). Each node
   costs its padded length.
2. **Units** (`subtree_units`): a subtree that fits the budget together with the path above it is
   one unit (a root's subtree when it fits: a GRPO group, or a system prompt with every prompt and
   response below it). A subtree over the budget is split into its children's subtrees and the
   samples that end in its root node, each part carrying the path above it, which is then computed
   once in every micro-batch holding a part (exact, less shared; warned once). A sample whose own
   sequence exceeds the budget is refused, naming the settings to raise.
3. **First-fit decreasing** (`first_fit_decreasing`): units, largest first, each into the first
   micro-batch where it fits, counting only the nodes that micro-batch does not hold yet: the parts
   of a split subtree fill the micro-batch that already holds their prefix.
4. **The count** is agreed across data-parallel ranks (and rounded for virtual pipelines) as verl
   agrees it; a rank that needs fewer splits its largest micro-batches; verl's order (the smaller
   micro-batches at both ends).

Each micro-batch carries its plan to the forward step (`PLAN_KEY`): a micro-batch that is the whole
batch carries the batch's plan, tree and order included (its tree is not built again); any other
carries the settings alone, and the forward step decides its tree once.

A micro-batch's own layout holds at most the tokens counted, up to two things not counted: the CP
padding of the whole pack (at most 2 x TP x CP tokens), and, in a tree with `tree_min_shared` > 0,
a short node kept in the batch's tree only because a sample of another micro-batch ends there
(pushed into each of its children in this micro-batch's tree: fewer than `tree_min_shared` tokens
per child).

Batches without a plan (the stock engine, sharing off) go to verl's function unchanged. The
trainer-side split over data-parallel ranks (`group_dp_partitions`) and the static-size warning
(`keep_groups_whole`) are here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from ps_bridge.plan import SharingPlan
from ps_bridge.tree.split import (  # noqa: F401 (re-exported)
    PackedCosts, Unit, bin_tokens, budget_micro_batches, first_fit_decreasing, packed_costs, split_to_count,
    subtree_units, warn_once,
)
from ps_bridge.verl.batch import per_sample_temperature, samples_of, temperature_classes, uid_list

logger = logging.getLogger("ps_bridge")

# the non-tensor entry of verl's TensorDict holding a `SharingPlan` (the mini-batch's, then each
# micro-batch's): verl passes a micro-batch to the forward step as the object `prepare_micro_batches`
# returned, its non-tensor entries untouched
PLAN_KEY = "ps_bridge_sharing_plan"

# ---- static micro-batch sizes ------------------------------------------------------------------


def group_run_length(uids) -> int:
    """n when `uids` come in equal runs of n adjacent samples with n > 1 (verl's
    `repeat(n, interleave=True)`), else 1."""
    if uids is None or len(uids) == 0:
        return 1
    runs = []
    count = 1
    for a, b in zip(uids[:-1], uids[1:]):
        if a == b:
            count += 1
        else:
            runs.append(count)
            count = 1
    runs.append(count)
    if len(set(runs)) == 1 and runs[0] > 1 and len(set(uids)) == len(runs):
        return runs[0]
    return 1


def keep_groups_whole(data) -> None:
    """Static micro-batch sizes: a size that is a multiple of n keeps groups whole, any other splits
    them (exact, shares less; said once). Dynamic sizes are formed by `prefix_aware_micro_batches`."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.utils import tensordict_utils as tu

    n = group_run_length(uid_list(data))
    if n == 1 or tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=True):
        return
    mbs = tu.get_non_tensor_data(data, key="micro_batch_size_per_gpu", default=None)
    if mbs is not None and mbs % n:
        warn_once(
            "static",
            "[PS][prepare] micro_batch_size_per_gpu=%s is not a multiple of the group size %d: groups are "
            "split across micro-batches (results stay exact, less is shared)", mbs, n,
        )


# ---- dynamic sizes: the mark, the batch's layout -------------------------------------------------


def mark_plan(data, plan: SharingPlan) -> None:
    """Hand `data` its sharing plan: `prefix_aware_micro_batches` forms its micro-batches, the forward
    step packs each with the plan its micro-batch carries."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor_data(data, PLAN_KEY, plan)


def plan_of(data) -> Optional[SharingPlan]:
    """The sharing plan `data` carries, or None (the stock engine's batches, sharing off)."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data, key=PLAN_KEY, default=None)


def batch_plan(data) -> SharingPlan:
    """The plan of the whole marked batch decided for its samples: its tree and pack order, as the
    forward step would pack them in one micro-batch."""
    samples = samples_of(data)  # with their images: prompts of other images are other prompts
    classes = None
    if "temperature" in data.keys():
        classes = temperature_classes(per_sample_temperature(data, len(samples), "cpu"))
    return plan_of(data).for_samples(samples, share_classes=classes)


def batch_costs(plan: SharingPlan) -> PackedCosts:
    """Each node's padded length and place in the pack of a plan decided for its samples (the pack
    itself is not materialized)."""
    _, offsets, prompt_lengths = plan.tree.sequences
    return packed_costs(plan.tree, plan.order, np.diff(offsets), prompt_lengths, plan.pad_multiple)


def prefix_aware_micro_batches(data, dp_group=None, num_batches_divided_by=None, same_micro_num_in_dp=True,
                               min_num_micro_batch=None, **_ignored):
    """verl's `prepare_micro_batches` contract (micro-batches, sample index lists) for a batch our
    engine marked; see the module docstring."""
    # imported here: verl is optional (requirements-verl.txt)
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_name
    from verl.utils.seqlen_balancing import roundup_divisible

    budget = int(data["max_token_len_per_gpu"]) * int(tu.get_non_tensor_data(data, key="sp_size", default=1))
    plan = batch_plan(data)
    units, cost = subtree_units(batch_costs(plan), budget)
    bins = first_fit_decreasing(units, cost, budget)

    sync = dist.is_initialized() and same_micro_num_in_dp and dp_group is not None

    def agree(value: int, largest: bool) -> int:
        """The largest (else smallest) value over the data-parallel ranks."""
        if not sync:
            return value
        t = torch.tensor([value if largest else -value], device=get_device_name())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
        return int(t.item()) if largest else -int(t.item())

    k = max(len(bins), min_num_micro_batch or 0)
    k = agree(k, largest=True)
    if num_batches_divided_by is not None:
        k = roundup_divisible(k, num_batches_divided_by)
    fewest_samples = agree(len(data), largest=False)
    if k > fewest_samples:
        raise ValueError(f"cannot form {k} non-empty micro-batches from {fewest_samples} samples within the token "
                         f"budget {budget}: raise the *_max_token_len_per_gpu settings")
    bins = split_to_count(units, bins, k, cost)
    bins.sort(key=lambda members: bin_tokens(units, members, cost), reverse=True)
    bins = bins[::2][::-1] + bins[1::2]  # verl's order: the smaller micro-batches at both ends
    indices = [sorted(i for u in members for i in units[u].samples) for members in bins]
    # the whole batch in its order is the batch itself, shallow-copied (keys set on the micro-batch stay
    # its own, as on a selected one): verl's index_select copies every tensor, the nested ones sample by
    # sample, tens of milliseconds of host time for a batch of 64 samples
    whole = list(range(len(data)))
    micro_batches = [data.copy() if idx == whole else tu.index_select_tensor_dict(data, idx) for idx in indices]
    for micro_batch, idx in zip(micro_batches, indices):
        # the whole batch in one micro-batch: the same samples in the same order, the same tree
        mark_plan(micro_batch, plan if len(idx) == len(data) else plan.settings_only())
    return micro_batches, indices


def install_prefix_aware_micro_batching() -> None:
    """verl's Megatron engine calls its module's `prepare_micro_batches`; route the batches our engine
    marked to `prefix_aware_micro_batches`, every other batch (the stock engine's) to verl's own
    function, unchanged. Idempotent."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.megatron import transformer_impl

    stock = transformer_impl.prepare_micro_batches
    if getattr(stock, "__ps_bridge__", False):
        return

    def prepare_micro_batches(data, *args, **kwargs):
        if plan_of(data) is not None and tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=True):
            return prefix_aware_micro_batches(data, *args, **kwargs)
        return stock(data, *args, **kwargs)

    prepare_micro_batches.__ps_bridge__ = True
    prepare_micro_batches.__wrapped__ = stock
    transformer_impl.prepare_micro_batches = prepare_micro_batches


# ---- the trainer side: whole groups per data-parallel rank ------------------------------------------


def group_dp_partitions(uids: Sequence, prompt_len: Sequence[int], total_len: Sequence[int],
                        dp_size: int) -> List[List[int]]:
    """The trainer-side split of a batch over data-parallel ranks that prefix sharing needs: whole
    groups (same uid) per rank, balanced by packed tokens (each prompt once), `dp_size` lists of
    sample indices. verl's own `get_group_balanced_partitions` (what `actor.use_prefix_grouper=True`
    turns on in `RayPPOTrainer._balance_batch`) keeps groups whole too but balances unshared tokens."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    order: dict = {}
    for i, u in enumerate(uids):
        order.setdefault(u, []).append(i)
    groups = list(order.values())
    if len(groups) < dp_size:
        raise ValueError(f"{len(groups)} groups cannot fill {dp_size} data-parallel ranks with whole groups")
    tokens = [prompt_len[g[0]] + sum(total_len[i] - prompt_len[i] for i in g) for g in groups]
    parts = get_seqlen_balanced_partitions(tokens, dp_size, equal_size=len(groups) % dp_size == 0)
    return [sorted(i for gi in part for i in groups[gi]) for part in parts]
