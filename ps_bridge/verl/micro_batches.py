"""verl's micro-batches for the prefix-shared engine: budgets in the tokens a packed micro-batch
holds, samples that share a prefix kept together.

verl forms dynamic micro-batches (`prepare_micro_batches` -> `rearrange_micro_batches`) from a token
budget that counts every sample's whole sequence. With sharing on, our engine marks the batch
(`mark_packed_budget`: the budget then counts packed tokens, with the layout settings the forward
step packs with) and `prefix_aware_micro_batches` forms the micro-batches, in four steps:

1. **What is shared** is the layout's decision: `build_layout` over the whole batch with the forward
   step's settings (identical prompts, or the token prefix tree with `tree`; samples of different
   temperatures share nothing). Each segment (a node of the tree) costs its padded length.
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

A micro-batch's own layout holds at most the tokens counted, up to two things not counted: the CP
padding of the whole pack (at most 2 x TP x CP tokens), and, in a tree with `tree_min_shared` > 0,
a short node kept in the batch's tree only because a sample of another micro-batch ends there
(pushed into each of its children in this micro-batch's tree: fewer than `tree_min_shared` tokens
per child).

Batches without the mark (the stock engine, sharing off) go to verl's function unchanged. The
trainer-side split over data-parallel ranks (`group_dp_partitions`) and the static-size warning
(`keep_groups_whole`) are here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from ps_bridge.layout import PackedPrefixLayout, build_layout
from ps_bridge.verl.batch import per_sample_temperature, samples_from_micro_batch, temperature_classes, uid_list

logger = logging.getLogger("ps_bridge")

PACKED_BUDGET_KEY = "ps_bridge_packed_budget"
PAD_MULTIPLE_KEY = "ps_bridge_pad_multiple"
SHARE_KEY = "ps_bridge_share"  # "prompt" or "tree": what the forward step's layout shares
MIN_SHARED_KEY = "ps_bridge_tree_min_shared"  # -1: the layout's default
MAX_DEPTH_KEY = "ps_bridge_tree_max_depth"  # -1: no limit

_warned: set = set()


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _round_up(x, m: int):
    return -(-x // m) * m


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
    from verl.utils import tensordict_utils as tu

    n = group_run_length(uid_list(data))
    if n == 1 or tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=True):
        return
    mbs = tu.get_non_tensor_data(data, key="micro_batch_size_per_gpu", default=None)
    if mbs is not None and mbs % n:
        _warn_once(
            "static",
            "[PS][prepare] micro_batch_size_per_gpu=%s is not a multiple of the group size %d: groups are "
            "split across micro-batches (results stay exact, less is shared)", mbs, n,
        )


# ---- dynamic sizes: the mark, the batch's layout -------------------------------------------------


def mark_packed_budget(data, share, pad_multiple: int, min_shared: Optional[int], max_depth: Optional[int]) -> None:
    """Mark `data` for `prefix_aware_micro_batches`, with the forward step's layout settings (`share`:
    True / "prompt" or "tree", as `PrefixSharingConfig.layout_share()` gives it)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, **{
        PACKED_BUDGET_KEY: True, PAD_MULTIPLE_KEY: int(pad_multiple), SHARE_KEY: "tree" if share == "tree" else "prompt",
        MIN_SHARED_KEY: -1 if min_shared is None else int(min_shared),
        MAX_DEPTH_KEY: -1 if max_depth is None else int(max_depth),
    })


def batch_layout(data) -> PackedPrefixLayout:
    """The layout of the whole marked batch, as the forward step would pack it in one micro-batch."""
    from verl.utils import tensordict_utils as tu

    get = lambda key, default: tu.get_non_tensor_data(data, key=key, default=default)  # noqa: E731
    samples = samples_from_micro_batch(data)
    classes = None
    if "temperature" in data.keys():
        classes = temperature_classes(per_sample_temperature(data, len(samples), "cpu"))
    min_shared, max_depth = int(get(MIN_SHARED_KEY, -1)), int(get(MAX_DEPTH_KEY, -1))
    return build_layout(
        samples, share="tree" if get(SHARE_KEY, "prompt") == "tree" else True, pad_multiple=int(get(PAD_MULTIPLE_KEY, 1)),
        min_shared=None if min_shared < 0 else min_shared, max_depth=None if max_depth < 0 else max_depth,
        share_classes=classes,
    )


# ---- units: subtrees that fit, each with the path above it ---------------------------------------


@dataclass
class Unit:
    """Samples a micro-batch takes together: the layout's nodes they need (the subtree and the path
    above it) and, for a sample packed on its own, its `private` padded length instead of nodes."""

    samples: List[int]
    nodes: Tuple[int, ...]
    private: int = 0


def subtree_units(layout: PackedPrefixLayout, budget: int) -> Tuple[List[Unit], np.ndarray]:
    """Units of `layout` within `budget` packed tokens (step 2 of the module docstring), and each
    node's cost (its padded length)."""
    cost = np.asarray(layout.host["padded_lengths"], dtype=np.int64)
    parent = layout.host["segment_parent"]
    tin, tout = layout.segment_tin.cpu().numpy(), layout.segment_tout.cpu().numpy()
    by_tin = np.argsort(tin)  # the node at each depth-first index
    cum = np.concatenate([[0], np.cumsum(cost[by_tin])])
    subtree_cost = cum[tout] - cum[tin]
    terminal = layout.sample_segment.cpu().numpy()
    lengths = layout.row_offsets.diff().cpu().numpy()
    prompt = layout.sample_prompt_length.cpu().numpy()
    own = _round_up(lengths, layout.pad_multiple)
    too_long = np.nonzero(own > budget)[0]
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"a sample of {int(lengths[i])} tokens (prompt {int(prompt[i])}) does not fit the micro-batch token "
            f"budget of {budget}: raise actor_rollout_ref.actor.ppo_max_token_len_per_gpu / "
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu / "
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
        )
    sample_order = np.argsort(tin[terminal], kind="stable")
    sample_tin = tin[terminal][sample_order]

    def samples_below(n: int) -> List[int]:
        a, b = np.searchsorted(sample_tin, [tin[n], tout[n]])
        return sorted(sample_order[a:b].tolist())

    children: List[List[int]] = [[] for _ in parent]
    for n, p in enumerate(parent):
        if p >= 0:
            children[p].append(n)
    ends_in: List[List[int]] = [[] for _ in parent]
    for i, n in enumerate(terminal.tolist()):
        ends_in[n].append(i)
    units: List[Unit] = []
    todo = [(n, ()) for n in range(len(parent)) if parent[n] < 0]
    while todo:
        n, path = todo.pop()
        above = int(cost[list(path)].sum())
        if above + subtree_cost[n] <= budget:
            units.append(Unit(samples_below(n), path + tuple(by_tin[tin[n]:tout[n]].tolist())))
            continue
        below = samples_below(n)
        _warn_once(
            "budget",
            "[PS][prepare] %d samples below a shared prefix hold %d packed tokens, more than the micro-batch budget "
            "%d: they are split across micro-batches (the prefix is computed once in each; results stay exact, "
            "less is shared); raise the *_max_token_len_per_gpu settings to keep them together",
            len(below), above + int(subtree_cost[n]), budget,
        )
        if above + cost[n] > budget:  # not even the path through n fits: each sample below it on its own
            units.extend(Unit([i], (), int(own[i])) for i in below)
            continue
        if ends_in[n]:
            units.append(Unit(ends_in[n], path + (n,)))
        todo.extend((c, path + (n,)) for c in children[n])
    return units, cost


# ---- first-fit decreasing, the count agreed over data-parallel ranks --------------------------------


def bin_tokens(units: Sequence[Unit], members: Sequence[int], cost: np.ndarray) -> int:
    """Packed tokens of a micro-batch holding `members` (unit indices): each node once."""
    nodes = set().union(*(units[u].nodes for u in members)) if members else set()
    return int(cost[list(nodes)].sum()) + sum(units[u].private for u in members)


def first_fit_decreasing(units: Sequence[Unit], cost: np.ndarray, budget: int) -> List[List[int]]:
    """Unit indices per micro-batch: each unit, largest first, into the first micro-batch where the
    nodes it adds (those the micro-batch does not hold yet) fit the budget."""
    alone = [bin_tokens(units, [u], cost) for u in range(len(units))]
    bins: List[Tuple[set, List[int]]] = []
    tokens: List[int] = []
    for u in sorted(range(len(units)), key=lambda u: (-alone[u], u)):
        for b, (nodes, members) in enumerate(bins):
            extra = int(sum(int(cost[n]) for n in units[u].nodes if n not in nodes)) + units[u].private
            if tokens[b] + extra <= budget:
                nodes.update(units[u].nodes)
                members.append(u)
                tokens[b] += extra
                break
        else:
            bins.append((set(units[u].nodes), [u]))
            tokens.append(alone[u])
    return [members for _, members in bins]


def split_to_count(units: List[Unit], bins: List[List[int]], k: int, cost: np.ndarray) -> List[List[int]]:
    """`bins` split until there are `k` (every bin stays within its budget: a part holds a subset of
    its nodes): the largest splittable bin gives half its units to a new bin, or, holding one unit,
    half that unit's samples. Needs at least `k` samples in all."""
    bins = [list(b) for b in bins]
    while len(bins) < k:
        splittable = [b for b in bins if len(b) > 1 or len(units[b[0]].samples) > 1]
        b = max(splittable, key=lambda members: bin_tokens(units, members, cost))
        if len(b) > 1:
            bins.append(b[1::2])
            del b[1::2]
        else:
            unit = units[b[0]]
            half = len(unit.samples) // 2
            units[b[0]] = Unit(unit.samples[:half], unit.nodes, unit.private)
            units.append(Unit(unit.samples[half:], unit.nodes, unit.private))
            bins.append([len(units) - 1])
    return bins


def prefix_aware_micro_batches(data, dp_group=None, num_batches_divided_by=None, same_micro_num_in_dp=True,
                               min_num_micro_batch=None, **_ignored):
    """verl's `prepare_micro_batches` contract (micro-batches, sample index lists) for a batch our
    engine marked; see the module docstring."""
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_name
    from verl.utils.seqlen_balancing import roundup_divisible

    budget = int(data["max_token_len_per_gpu"]) * int(tu.get_non_tensor_data(data, key="sp_size", default=1))
    units, cost = subtree_units(batch_layout(data), budget)
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
    return [tu.index_select_tensor_dict(data, idx) for idx in indices], indices


def install_prefix_aware_micro_batching() -> None:
    """verl's Megatron engine calls its module's `prepare_micro_batches`; route the batches our engine
    marked to `prefix_aware_micro_batches`, every other batch (the stock engine's) to verl's own
    function, unchanged. Idempotent."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.megatron import transformer_impl

    stock = transformer_impl.prepare_micro_batches
    if getattr(stock, "__ps_bridge__", False):
        return

    def prepare_micro_batches(data, *args, **kwargs):
        if tu.get_non_tensor_data(data, key=PACKED_BUDGET_KEY, default=False) and \
                tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=True):
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
