"""What a micro-batch shares: one immutable plan, decided once and handed to everything that reads it.

A `SharingPlan` holds the settings of the sharing (the share mode when sharing is on: identical prompts
or the token prefix tree; the shortest shared run and the depth limit of a tree; the padding multiple of
each segment) and, once decided for a set of samples, their prefix tree and its pack order. It is
built from a `PrefixSharingConfig` (`SharingPlan.from_config`) and decided for samples with
`for_samples`, which builds the tree (`layout.decide_tree`) only where the plan does not hold one for
those samples already: the micro-batcher's costs (`ps_bridge.verl.micro_batches`), the sharing rule's
token count (`launch_rule.sharing_for(trie=...)`) and the layout (`build_layout(tree=..., order=...)`)
then read the same tree.

Under verl the engine decides the plan of each mini-batch (`forward_backward_batch`) and hands it,
as one object, to the micro-batcher, which decides the mini-batch's tree for its costs and gives each
micro-batch its plan: the mini-batch's own (tree included) where the micro-batch is the whole
mini-batch, the settings alone otherwise (the forward step then decides that micro-batch's tree, once).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Hashable, Optional, Sequence, Tuple

import numpy as np

from ps_bridge.images import has_images, image_signature
from ps_bridge.layout import SHARE_MODES, SampleBatch, decide_tree
from ps_bridge.tree.decide import PrefixTree
from ps_bridge.tree.order import PackOrder, pack_order


@dataclass(frozen=True)
class SharingPlan:
    """See the module docstring. `share`: what sharing shares when the sharing rule lets a micro-batch
    share ("prompt": identical prompts, one level; "tree": every common prefix; `from_config` takes
    it from `PrefixSharingConfig.tree`, which owns the default). `min_shared` /
    `max_depth`: the tree's limits (None: `layout.DEFAULT_MIN_SHARED` / no limit). `pad_multiple`: each
    segment's padding multiple (the TP size under verl). `bucket`: segments padded to their level's
    bucket length (`build_layout(bucket=True)`, for CUDA graphs); `level_buckets`: each level's block
    padded to a bucket instead (`build_layout(level_buckets=True)`). `tree`, `order`, `classes`: the prefix tree of
    the samples the plan was decided for, its pack order, the share classes it was decided with and
    those samples."""

    share: str
    min_shared: Optional[int] = None
    max_depth: Optional[int] = None
    pad_multiple: int = 1
    bucket: bool = False
    level_buckets: bool = False
    tree: Optional[PrefixTree] = field(default=None, compare=False, repr=False)
    order: Optional[PackOrder] = field(default=None, compare=False, repr=False)
    classes: Optional[Tuple[Hashable, ...]] = field(default=None, compare=False, repr=False)
    samples: Optional[Sequence] = field(default=None, compare=False, repr=False)  # the ones it was decided for

    def __post_init__(self):
        if self.share not in SHARE_MODES:
            raise ValueError(f"a sharing plan shares 'prompt' or 'tree', got {self.share!r}")
        if self.pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {self.pad_multiple}")

    @classmethod
    def from_config(cls, config, pad_multiple: int = 1, bucket: bool = False) -> "SharingPlan":
        """The plan of a `PrefixSharingConfig`: its tree settings, `pad_multiple` (the caller's: the
        config's `pad_multiple`, or the TP size) and `bucket` (the caller's: whether the model's
        forward runs as CUDA graphs, `cuda_graphs.buckets_for`), in the config's `cuda_graph_buckets`."""
        bucket = bool(bucket)
        return cls(share="tree" if config.tree else "prompt", min_shared=config.tree_min_shared,
                   max_depth=config.tree_max_depth, pad_multiple=int(pad_multiple), bucket=bucket,
                   level_buckets=bucket and config.cuda_graph_buckets == "level")

    @property
    def layout_share(self):
        """What `build_layout(share=...)` gets where the micro-batch shares."""
        return "tree" if self.share == "tree" else True

    def holds_tree_of(self, samples: Sequence, share_classes: Optional[Sequence[Hashable]]) -> bool:
        """Whether the plan's tree was decided for these samples with these share classes: the very
        list it was decided for, or the same tokens, lengths and prompt lengths (compared as arrays: a
        `SampleBatch` keeps them; other samples are not compared and get their own tree)."""
        classes = None if share_classes is None else tuple(share_classes)
        if self.tree is None or self.tree.num_samples != len(samples) or self.classes != classes:
            return False
        if samples is self.samples:
            return True
        # equal placeholder tokens of different images: another tree (ps_bridge.images)
        images = tuple(map(image_signature, samples)) if has_images(samples) else None
        if images != self.tree.images:
            return False
        mine = self.tree.sequences
        theirs = samples.sequences() if isinstance(samples, SampleBatch) else None
        return mine is not None and theirs is not None and all(np.array_equal(a, b) for a, b in zip(mine, theirs))

    def for_samples(self, samples: Sequence, *, share_classes: Optional[Sequence[Hashable]] = None,
                    vocab_size: Optional[int] = None) -> "SharingPlan":
        """This plan decided for `samples`: itself where it holds their tree already, else a plan with
        their prefix tree (ids checked against `vocab_size`) and its pack order."""
        if self.holds_tree_of(samples, share_classes):
            return self
        tree = decide_tree(samples, self.layout_share, vocab_size=vocab_size, min_shared=self.min_shared,
                           max_depth=self.max_depth, share_classes=share_classes)
        classes = None if share_classes is None else tuple(share_classes)
        return replace(self, tree=tree, order=pack_order(tree), classes=classes, samples=samples)

    def settings_only(self) -> "SharingPlan":
        """The plan without a tree: for other samples than the ones it was decided for."""
        return replace(self, tree=None, order=None, classes=None, samples=None)
