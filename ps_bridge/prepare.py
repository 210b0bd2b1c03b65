"""Decide what a micro-batch shares, then build its layout: the one owner of that step.

`decided_layout` is what `runtime.make_layout` (`ps-bridge logprobs`, the schedule, the tests) and the
verl engine's forward step (`ps_bridge.verl.engine`) both run:

1. with `config.tree`, the token prefix tree is decided once (`layout.decide_tree`, with the share
   classes: samples of different classes, e.g. sampling temperatures, share no position);
2. the sharing rule (`launch_rule.sharing_for`) decides whether the micro-batch runs shared, reading
   the tree's token count (host integers only: every TP/CP/PP rank decides alike);
3. `build_layout` packs that decision (the tree above, not decided again); where the rule chose to
   share but the packing holds nothing shared (samples that share a prefix carry different share
   classes), the unshared layout is packed instead, the stock computation;
4. the `[PS][prepare]` lines: the decision and the layout (`log_layout`).

A caller that already knows the packing (`share=True / False / "tree"`) skips the rule: no decision
is made, logged or returned.

Steps 1 and 2 are also callable alone, for a caller that decides for a whole batch and packs later:
`decided_tree` (step 1) and `decided_sharing` (step 2, logging the `sharing:` line). `ps-bridge
logprobs` runs them on its whole batch (the tree before loading the model, to check the ids and
report the trie, the rule once the model's cost is known), then every micro-batch runs that packing
(`decided_layout` with `share` given). `decided_layout` runs the same two functions: they are the one
place that decides a batch's tree and runs the sharing rule.
"""

from __future__ import annotations

import logging
from typing import Hashable, Optional, Sequence, Tuple, Union

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.forward import cp_total_multiple, shard_tag
from ps_bridge.launch_rule import ModelCost, SharingDecision, sharing_for
from ps_bridge.layout import PackedPrefixLayout, PrefixTree, build_layout, decide_tree, log_layout
from ps_bridge.parallel_info import rank_tag

logger = logging.getLogger("ps_bridge")


def decided_tree(
    samples: Sequence,
    config: PrefixSharingConfig,
    *,
    vocab_size: Optional[int],
    share_classes: Optional[Sequence[Hashable]] = None,
) -> PrefixTree:
    """Step 1: the tree `build_layout` packs for `config.layout_share()` (the prefix tree under
    `config.tree`, the one-level tree of identical prompts without it, one sequence per sample with
    sharing off), with `config`'s threshold and depth limit; the ids are checked against `vocab_size`
    (a bad id fails here, before any model work)."""
    return decide_tree(samples, config.layout_share(), vocab_size=vocab_size,
                       min_shared=config.tree_min_shared, max_depth=config.tree_max_depth,
                       share_classes=share_classes)


def decided_sharing(
    samples: Sequence,
    config: PrefixSharingConfig,
    cost: Optional[ModelCost],
    device_type: str,
    dtype,
    *,
    tree: Optional[PrefixTree],
    backward: Optional[bool] = None,
    log: bool = True,
) -> SharingDecision:
    """Step 2: the sharing rule's decision for `samples`, reading `tree`'s token count where `config`
    packs a prefix tree (`tree` from `decided_tree`; None: the rule counts the samples itself).
    `backward`: whether a backward pass follows (default: whether gradients are enabled). `log`: the
    `[PS][prepare] sharing:` line now (`decided_layout` logs it after its fallback instead)."""
    trie = tree if config.enabled and config.tree else None
    decision = sharing_for(samples, config, cost, device_type, str(dtype).replace("torch.", ""),
                           backward=backward, trie=trie)
    if log:
        log_decision(decision)
    return decision


def log_decision(decision: SharingDecision) -> None:
    """The `[PS][prepare][rank] sharing: ...` line."""
    logger.info("[PS][prepare][%s] sharing: %s", rank_tag(), decision.describe())


def decided_layout(
    samples: Sequence,
    config: PrefixSharingConfig,
    cost: Optional[ModelCost],
    device_type: str,
    dtype,
    *,
    pad_multiple: int,
    vocab_size: Optional[int],
    total_multiple: Optional[int] = None,
    share_classes: Optional[Sequence[Hashable]] = None,
    share: Optional[Union[bool, str]] = None,
) -> Tuple[PackedPrefixLayout, Optional[SharingDecision]]:
    """The layout of `samples` under `config` and the sharing rule's decision (None where `share` was
    given); see the module docstring. `dtype`: the model's parameter dtype (a torch dtype or its name),
    `cost`: the model's `ModelCost` (None: the rule always shares), `total_multiple`: what the pack is
    padded to (None: `cp_total_multiple()`, equal context-parallel shards)."""
    tree = None
    decision = None
    if share is None:
        if config.enabled and config.tree:
            tree = decided_tree(samples, config, vocab_size=vocab_size, share_classes=share_classes)
        decision = decided_sharing(samples, config, cost, device_type, dtype, tree=tree, log=False)
        share = decision.share
    share = config.layout_share(share)

    def pack(share, tree=None):
        return build_layout(
            samples, share=share, pad_multiple=pad_multiple, vocab_size=vocab_size,
            total_multiple=cp_total_multiple() if total_multiple is None else total_multiple,
            prompt_values=config.layout_prompt_values, min_shared=config.tree_min_shared,
            max_depth=config.tree_max_depth, share_classes=share_classes, tree=tree,
        )

    layout = pack(share, tree if share == "tree" else None)
    if decision is not None:
        if layout.shared and not layout.has_sharing:
            if decision.share and share_classes is not None:
                decision = SharingDecision(False, "samples that share a prefix carry different temperatures: not shared")
            # nothing to share: one THD sequence per sample, the stock engine's computation
            layout = pack(False)
        log_decision(decision)
    log_layout(layout, f"[{rank_tag()}]{shard_tag(layout)}")
    return layout, decision
