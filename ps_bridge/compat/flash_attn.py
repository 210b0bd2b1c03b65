"""What differs between the flash-attn 2.x releases the `flash_attn` attention kernel calls.

`flash_attn.flash_attn_interface._flash_attn_varlen_forward` / `_backward` take the same leading
positional arguments in 2.x, but their keyword lists changed across releases: the sliding window is
`window_size=(left, right)` in older 2.x releases and `window_size_left` / `window_size_right` in
newer ones; `softcap`, `alibi_slopes` and `deterministic` exist in some releases only
(`varlen_keywords`). flash-attn is not installed on the machines these were tested on (no release
is pinned; `ps_bridge/kernels/attention/varlen.py` `FlashAttnKernel` is its only caller).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Tuple


def varlen_functions() -> Tuple[Callable, Callable]:
    """flash-attn's `(_flash_attn_varlen_forward, _flash_attn_varlen_backward)`."""
    # imported here: flash-attn is optional (GPU kernels)
    from flash_attn import flash_attn_interface as fai

    return fai._flash_attn_varlen_forward, fai._flash_attn_varlen_backward


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def varlen_keywords(fn: Callable, **kwargs) -> dict:
    """`kwargs` and the keywords that make `fn` (one of `varlen_functions`) full causal attention
    without extras, in the spelling this flash-attn takes: no sliding window (`window_size_left=-1,
    window_size_right=-1`, or `window_size=(-1, -1)`), `softcap=0.0`, `alibi_slopes=None`,
    `deterministic=False`, each only where `fn` takes it."""
    params = _parameters(fn)
    if "window_size_left" in params:
        kwargs.update(window_size_left=-1, window_size_right=-1)
    elif "window_size" in params:
        kwargs.update(window_size=(-1, -1))
    for name, value in (("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False)):
        if name in params:
            kwargs[name] = value
    return kwargs
