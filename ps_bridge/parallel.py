"""Parallel settings of a prefix-shared run, and what a run needs beyond the model itself.

Prefix sharing supports tensor parallelism (TP), TP-bound sequence parallelism (SP) and physical
pipeline parallelism (PP); it refuses context parallelism (CP) and virtual pipeline stages. The
model is parallelised from outside, by megatron-core: this module only checks the settings up
front (so a refused setting fails before any process group exists, on every rank alike, without
hanging), finishes gradients the way megatron's `finalize_model_grads` would without a DDP wrapper,
and gathers sharded gradients under Hugging Face names for comparisons.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelSettings:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    vpp: Optional[int] = None

    def check(self, world_size: Optional[int] = None) -> None:
        """Raise ValueError naming the setting if prefix sharing or this world cannot run it."""
        from ps_bridge.providers.base import check_parallel_settings

        sizes = (
            ("tensor_model_parallel_size", self.tp),
            ("pipeline_model_parallel_size", self.pp),
            ("context_parallel_size", self.cp),
        )
        for name, value in sizes:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        check_parallel_settings(
            SimpleNamespace(context_parallel_size=self.cp, virtual_pipeline_model_parallel_size=self.vpp)
        )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1 (SP is bound to TP)")
        world_size = launched_world_size() if world_size is None else world_size
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x pipeline x context parallel size "
                f"{self.tp} x {self.pp} x {self.cp} = {model_parallel}"
            )


def launched_world_size() -> int:
    """The world size torchrun launched (1 when run as a plain process)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_output_rank() -> bool:
    """Global rank 0 writes files and prints results; every rank logs its own `[PS]` lines."""
    return not dist.is_initialized() or dist.get_rank() == 0


def max_over_ranks(value: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _collective_device() -> torch.device:
    # NCCL collectives need CUDA tensors; gloo takes CPU tensors
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# ---- gradients ---------------------------------------------------------------------------------


def _needs_tp_sum(name: str, param: torch.nn.Parameter, config) -> bool:
    """Replicated parameters whose gradient is partial on each TP rank: norms under SP (each rank saw
    its share of the tokens) and q/k norms (each rank saw its share of the heads). The same rule as
    megatron's `_allreduce_non_tensor_model_parallel_grads`."""
    if getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False):
        return True
    return bool(getattr(config, "qk_layernorm", False)) and ("q_layernorm" in name or "k_layernorm" in name)


def finish_gradients(model: torch.nn.Module, config) -> None:
    """Reduce the partial gradients of replicated parameters after a backward pass.

    megatron's `finalize_model_grads` does this inside its DDP wrapper; verl training uses that.
    Our runs (CLI, demo, tests) call the model without DDP, so they finish gradients here:
    TP sum for SP norms and q/k norms, mean across TP for `average_gradients_across_tp_domain`
    parameters, and the tied word-embedding sum between the first and last pipeline stage.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) > 1:
        for name, param in model.named_parameters():
            if param.grad is None:
                continue
            if getattr(param, "average_gradients_across_tp_domain", False):
                dist.all_reduce(param.grad, group=tp_group)
                param.grad /= dist.get_world_size(tp_group)
            elif _needs_tp_sum(name, param, config):
                dist.all_reduce(param.grad, group=tp_group)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and parallel_state.is_rank_in_embedding_group():
        embedding_group = parallel_state.get_embedding_group()
        if dist.get_world_size(embedding_group) > 1:
            for param in model.parameters():
                if getattr(param, "shared_embedding", False) and param.grad is not None:
                    dist.all_reduce(param.grad, group=embedding_group)


def hf_named_gradients(bridge, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full (unsharded) gradients under Hugging Face names, on every rank.

    Megatron-Bridge's export already knows how each parameter is split across TP ranks and PP
    stages (fused QKV, gated MLP halves, GDN heads), so the gradients are exported as if they were
    the weights: swap each parameter's data for its gradient, export, swap back. Every rank must
    call this (the export gathers across TP and PP).

    Some mappings are affine, not linear: Qwen3.5's GDN output norm is zero-centred in megatron and
    a plain scale in HF, so its export adds 1. The gradient is therefore export(grad) - export(0),
    both computed in float64 so that adding and removing the 1 loses nothing of a small gradient.
    """
    params = list(model.parameters())
    saved = [p.data for p in params]

    def export(fill) -> Dict[str, torch.Tensor]:
        for p in params:
            p.data = fill(p)
        return {name: t.detach().double().cpu().clone() for name, t in bridge.export_hf_weights([model], cpu=True, show_progress=False)}

    try:
        grads = export(lambda p: p.grad.detach().double() if p.grad is not None else torch.zeros_like(p.data, dtype=torch.float64))
        offsets = export(lambda p: torch.zeros_like(p.data, dtype=torch.float64))
    finally:
        for p, data in zip(params, saved):
            p.data = data
    return {name: (g - offsets[name]).float() for name, g in grads.items()}


# ---- command line --------------------------------------------------------------------------------


def add_parallel_arguments(parser) -> None:
    """`--tp`, `--pp`, `--sp`, `--cp` for a command that runs under `torchrun --nproc-per-node N`."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (physical stages)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (not supported: refused)")


def settings_from_args(args) -> ParallelSettings:
    return ParallelSettings(tp=args.tp, pp=args.pp, cp=args.cp, sequence_parallel=args.sp)
