"""verl's packed mRoPE position ids when every sample of a batch has the same length.

verl 0.9.1 packs a batch's position ids with `torch.nested.as_nested_tensor(list, layout=torch.jagged)`
(verl/workers/utils/padding.py:67). A model with mRoPE (Qwen3.5, Qwen2.5-VL, Qwen3-VL) has per-sample
position ids of shape `[4, length]`; torch makes the dimension whose sizes differ the ragged one, so when
all samples have one length it takes the first (the 4), giving offsets `[0, 4, 8, ...]` over values of shape
`[batch * 4, length]`. verl's workers then set the ragged dimension to 2 (`maybe_fix_3d_position_ids`,
verl/utils/tensordict_utils.py:910, a workaround for tensordict's pickling), which no longer matches those
offsets: the next index or unbind fails ("split_with_sizes expects split_sizes to sum exactly to ...").
Seen in `make grpo --model qwen3.5` at a step whose 8 samples all had 52 tokens.

`install()` wraps verl's `maybe_fix_3d_position_ids` (and the name in the modules that imported it) to first
rebuild such a tensor as verl builds it for unequal lengths: values `[4, total]` and the samples' offsets.
It changes nothing for any other tensor, and nothing where verl has no such function (0.8.0)."""

from __future__ import annotations

import functools
import importlib
import sys

import torch

# the modules that call verl's function by the name they imported (verl 0.9.1)
_CALLERS = ("verl.utils.tensordict_utils", "verl.workers.engine_workers", "verl.workers.engine.base")


def rebuilt_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """`position_ids` (nested, `[batch, k, j]`) with the sample length as its ragged dimension; as given when
    it already is."""
    if not (position_ids.is_nested and position_ids.dim() == 3):
        return position_ids
    values, offsets = position_ids.values(), position_ids.offsets()
    batch = offsets.numel() - 1
    if values.dim() != 2 or batch < 1 or int(offsets[-1]) == values.shape[1]:
        return position_ids  # values [k, total]: the length is the ragged dimension
    widths = offsets.diff()
    k = int(widths[0])
    if not bool((widths == k).all()) or values.shape[0] != batch * k:
        return position_ids
    # verl's own builder for unequal lengths: values [k, total], offsets of the samples' lengths
    # (verl/utils/tensordict_utils.py:162); verl is loaded wherever its batches are
    from verl.utils.tensordict_utils import nested_tensor_from_tensor_list

    samples = values.reshape(batch, k, values.shape[1])
    return nested_tensor_from_tensor_list(list(samples.unbind(0)), ragged_idx=2)


def install() -> bool:
    """Wrap verl's `maybe_fix_3d_position_ids` where verl has it (idempotent); False where it has not."""
    try:
        utils = importlib.import_module(_CALLERS[0])
    except ImportError:
        return False
    stock = getattr(utils, "maybe_fix_3d_position_ids", None)
    if stock is None:
        return False
    if getattr(stock, "__ps_bridge__", False):
        return True

    @functools.wraps(stock)
    def maybe_fix_3d_position_ids(data):
        if "position_ids" in data.keys():
            position_ids = data["position_ids"]
            if isinstance(position_ids, torch.Tensor):
                rebuilt = rebuilt_position_ids(position_ids)
                if rebuilt is not position_ids:
                    data["position_ids"] = rebuilt
        return stock(data)

    maybe_fix_3d_position_ids.__ps_bridge__ = True
    # a caller imported later takes the wrapped function by name from tensordict_utils
    for name in _CALLERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "maybe_fix_3d_position_ids", None) is stock:
            module.maybe_fix_3d_position_ids = maybe_fix_3d_position_ids
    return True
