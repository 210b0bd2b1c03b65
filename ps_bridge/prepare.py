"""Decide what a micro-batch shares, then build its layout: the one owner of that step.

`micro_batch_layout` is what `runtime.make_layout` (`ps-bridge logprobs`, the schedule, the tests) and
the verl engine's forward step (`ps_bridge.verl.engine`) both run, with the micro-batch's
`plan.SharingPlan` (the tree settings and padding; under verl also the tree, where the micro-batcher
decided it for these samples already):

1. with a prefix tree to share (`config.tree`), or a bucketed pack to count (`SharingPlan.bucket`:
   CUDA graphs), the plan is decided for the samples (`SharingPlan.for_samples`: the tree and its pack
   order, built only where the plan does not hold them; samples of different share classes, e.g.
   sampling temperatures, share no position);
2. the sharing rule (`rule_decision`: `launch_rule.sharing_for`) decides whether the micro-batch runs
   shared, and under CUDA graphs whether on a bucketed pack, reading the tree's token count and the
   bucketed pack's (host integers only: every TP/CP/PP rank decides alike);
3. `build_layout` packs that decision (the plan's tree and order, not decided again); where the rule
   chose to share but the packing holds nothing shared (samples that share a prefix carry different
   share classes), the unshared layout is packed instead, the stock computation;
4. the `[PS][prepare]` lines: the decision and the layout (`log_layout`).

A caller that already knows the packing (`share=True / False / "tree"`) skips the rule: no decision
is made, logged or returned.

`ps-bridge logprobs` decides for its whole batch first (the plan's tree before loading the model, to
check the ids and report the trie; `rule_decision` once the model's cost is known), then every
micro-batch runs that packing (`micro_batch_layout` with `share` given).
"""

from __future__ import annotations

import logging
from typing import Hashable, Optional, Sequence, Tuple, Union

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.forward import cp_total_multiple, shard_tag
from ps_bridge.launch_rule import ModelCost, SharingDecision, sharing_for
from ps_bridge.layout import PackedPrefixLayout, PrefixTree, build_layout, log_layout
from ps_bridge.parallel_info import rank_tag
from ps_bridge.plan import SharingPlan
from ps_bridge.tree.materialize import bucketed_tokens

logger = logging.getLogger("ps_bridge")

def rule_decision(
    samples: Sequence,
    config: PrefixSharingConfig,
    cost: Optional[ModelCost],
    device_type: str,
    dtype,
    *,
    tree: Optional[PrefixTree],
    backward: Optional[bool] = None,
    log: bool = True,
    graphs: bool = False,
    tokens_bucketed: Optional[int] = None,
) -> SharingDecision:
    """Step 2: the sharing rule's decision for `samples`, reading `tree`'s token count where `config`
    packs a prefix tree (`tree`: a `SharingPlan`'s, decided for `samples`; None: the rule counts the
    samples itself).
    `backward`: whether a backward pass follows (default: whether gradients are enabled). `log`: the
    `[PS][prepare] sharing:` line now (`micro_batch_layout` logs it with the layout instead).
    `graphs`: the passes replay CUDA graphs (`SharingPlan.bucket`), `tokens_bucketed`: the bucketed
    shared pack's tokens (`tree.materialize.bucketed_tokens`)."""
    trie = tree if config.enabled and config.tree else None
    decision = sharing_for(samples, config, cost, device_type, str(dtype).replace("torch.", ""),
                           backward=backward, trie=trie, graphs=graphs, tokens_bucketed=tokens_bucketed)
    if log:
        log_decision(decision)
    return decision


def log_decision(decision: SharingDecision) -> None:
    """The `[PS][prepare][rank] sharing: ...` line."""
    logger.info("[PS][prepare][%s] sharing: %s", rank_tag(), decision.describe())


def micro_batch_layout(
    samples: Sequence,
    config: PrefixSharingConfig,
    cost: Optional[ModelCost],
    device_type: str,
    dtype,
    *,
    plan: SharingPlan,
    vocab_size: Optional[int],
    total_multiple: Optional[int] = None,
    share_classes: Optional[Sequence[Hashable]] = None,
    share: Optional[Union[bool, str]] = None,
) -> Tuple[PackedPrefixLayout, Optional[SharingDecision]]:
    """The layout of `samples` under `config` and `plan` and the sharing rule's decision (None where
    `share` was given); see the module docstring. `dtype`: the model's parameter dtype (a torch dtype or
    its name), `cost`: the model's `ModelCost` (None: the rule always shares), `total_multiple`: what the
    pack is padded to (None: `cp_total_multiple()`, equal context-parallel shards)."""
    decision = None
    total_multiple = cp_total_multiple() if total_multiple is None else total_multiple
    # a caller that gives `share` packs it bucketed where the plan is (CUDA graphs)
    bucket = plan.bucket
    if share is None:
        if config.enabled and (config.tree or plan.bucket):
            plan = plan.for_samples(samples, share_classes=share_classes, vocab_size=vocab_size)
        tokens_bucketed = (bucketed_tokens(plan.tree, plan.order, plan.pad_multiple, total_multiple, plan.level_buckets)
                           if config.enabled and plan.bucket else None)
        decision = rule_decision(samples, config, cost, device_type, dtype,
                                 tree=plan.tree if config.enabled and config.tree else None, log=False,
                                 graphs=plan.bucket, tokens_bucketed=tokens_bucketed)
        share, bucket = decision.share, plan.bucket and decision.bucketed
    share = config.layout_share(share)

    def pack(share, reuse_plan: bool):
        # the plan's tree and order where they were decided for these samples and this share mode;
        # bucketed (for CUDA graphs) where shared: an unshared micro-batch is the stock computation
        usable = reuse_plan and share == plan.layout_share and plan.holds_tree_of(samples, share_classes)
        return build_layout(
            samples, share=share, pad_multiple=plan.pad_multiple, vocab_size=vocab_size,
            total_multiple=total_multiple, prompt_values=config.layout_prompt_values,
            min_shared=config.tree_min_shared, max_depth=config.tree_max_depth, share_classes=share_classes,
            tree=plan.tree if usable else None, order=plan.order if usable else None,
            bucket=bucket and share is not False, level_buckets=bucket and share is not False and plan.level_buckets,
        )

    layout = pack(share, True)
    if decision is not None:
        if layout.shared and not layout.has_sharing:
            if decision.share and share_classes is not None:
                decision = SharingDecision(False, "samples that share a prefix carry different temperatures: not shared")
            # nothing to share: one THD sequence per sample, the stock engine's computation
            layout = pack(False, False)
        log_decision(decision)
    log_layout(layout, f"[{rank_tag()}]{shard_tag(layout)}")
    return layout, decision
