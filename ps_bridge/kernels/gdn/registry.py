"""The Gated DeltaNet backends by name, and the `auto` choice.

A backend provides the two varlen kernels the prefix-shared GDN runs on (signatures in torch_ref.py):
`causal_conv1d(x, weight, bias, cu_seqlens, cu_seqlens_host, initial_state, output_final_state,
activation, chunk_indices=None)` and `gated_delta_rule(q, k, v, g, beta, scale, cu_seqlens,
cu_seqlens_host, initial_state, output_final_state, chunk_indices=None)` (`cu_seqlens_host` None:
offsets on the device only, with fla's chunk index of 64-token chunks). `auto` is an entry like the others; it picks a backend per call
with `choose_gdn_backend` (see `resolve_gdn_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import torch

from ps_bridge.kernels.backend import AUTO, Backend, lookup
from ps_bridge.kernels.gdn import fla, torch_ref

OP = "Gated DeltaNet"


@dataclass(frozen=True)
class GDNBackend(Backend):
    causal_conv1d: Callable
    gated_delta_rule: Callable


def choose_gdn_backend(device: torch.device, tree_depth: int = 1) -> str:
    """`auto`'s choice: fla's Triton kernels on CUDA, the reference elsewhere. Both run prefix trees
    of any depth (one call per tree level, `forked.py`); `tree_depth` does not change the choice."""
    return "fla" if torch.device(device).type == "cuda" else "torch_ref"


def _auto_causal_conv1d(x, *args, **kwargs):
    return resolve_gdn_backend(AUTO, x.device).causal_conv1d(x, *args, **kwargs)


def _auto_gated_delta_rule(q, *args, **kwargs):
    return resolve_gdn_backend(AUTO, q.device).gated_delta_rule(q, *args, **kwargs)


GDN_BACKENDS: Dict[str, GDNBackend] = {
    b.name: b
    for b in (
        GDNBackend(
            "torch_ref", "plain PyTorch, token by token; exact, the reference",
            None, None, torch_ref.causal_conv1d, torch_ref.gated_delta_rule,
        ),
        GDNBackend(
            "fla", "fla-core's Triton kernels (causal_conv1d, chunk_gated_delta_rule)",
            ("cuda",), None, fla.causal_conv1d, fla.gated_delta_rule,
        ),
        GDNBackend(AUTO, "fla on CUDA, torch_ref elsewhere", None, None, _auto_causal_conv1d, _auto_gated_delta_rule),
    )
}


def resolve_gdn_backend(name: str, device: torch.device, tree_depth: int = 1) -> GDNBackend:
    """The concrete backend `name` stands for on `device` for a prefix tree of depth `tree_depth`
    (`auto` resolved)."""
    device = torch.device(device)
    backend = lookup(GDN_BACKENDS, name, OP)
    if name == AUTO:
        backend = GDN_BACKENDS[choose_gdn_backend(device, tree_depth)]
    backend.check_device(device, OP)
    return backend


def check_gdn_backend_usable(name: str, device: torch.device, training: bool = True) -> None:
    """Fail early (at model build) when the selected backend cannot run the backward pass here."""
    backend = resolve_gdn_backend(name, device)
    if backend.name == "fla" and training:
        problem = fla.hopper_backward_problem(device)  # looked up at call time: tests replace it
        if problem:
            raise RuntimeError(problem)
