"""F for verl-check: per phase, the model FLOPs of verl's stock computation of the phase's samples over
those of the micro-batches the prefix-shared engine ran (`ps_bridge.tools.bench.flops`' conventions: forward +
backward counted for every phase, the forward-only ones included, so F is one convention throughout;
the stock side is every sample its own sequence with the output layer on every position, the shared
side each micro-batch's layout as built, its prefixes computed once per micro-batch). A phase whose
micro-batches split a shared prefix computes it once per part: F counts that, S does not."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ps_bridge.layout import build_layout
from ps_bridge.tools.bench.flops import FlopShape, flop_shape_of_config, model_flops
from ps_bridge.tools.verl_check.model import checkpoint_config


class PhaseFlops:
    """The shared engine's `layout_observer`: collects each packed micro-batch, `take()` counts them
    (after the phase, so the count is not timed)."""

    def __init__(self, shape: FlopShape):
        self.shape = shape
        self._seen: List[Tuple[Sequence, object]] = []

    def __call__(self, samples, layout) -> None:
        self._seen.append((samples, layout))

    def take(self) -> Dict[str, float]:
        """{"unshared": stock's FLOPs of the micro-batches' samples, "shared": the layouts' FLOPs};
        the collected micro-batches are dropped."""
        seen, self._seen = self._seen, []
        return {
            "unshared": sum(model_flops(self.shape, build_layout(s, share=False)) for s, _ in seen),
            "shared": sum(model_flops(self.shape, layout) for _, layout in seen),
        }


def checkpoint_flop_shape(ckpt: str) -> FlopShape:
    """The checkpoint's FLOP shape; a vision-language checkpoint's with its tower (counted on the
    images each micro-batch runs it on: every sample's unshared, the distinct ones shared)."""
    return flop_shape_of_config(checkpoint_config(ckpt))


def flop_ratios(steps: List[dict], kind: str = "shared", skip_first: bool = True) -> Optional[Dict[str, float]]:
    """Per phase, F over the steps (the first left out when there are more, as the speed-ups):
    summed unshared FLOPs over summed shared FLOPs; None where the steps hold no counts."""
    use = steps[1:] if skip_first and len(steps) > 1 else steps
    counts = [s.get("flops", {}).get(kind) for s in use]
    if not counts or any(not c for c in counts):
        return None
    out = {}
    for phase in counts[0]:
        shared = sum(c[phase]["shared"] for c in counts)
        out[phase] = sum(c[phase]["unshared"] for c in counts) / shared if shared else float("nan")
    return out
