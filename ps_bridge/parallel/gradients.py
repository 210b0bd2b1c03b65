"""Gradients of a run without megatron's DDP wrapper: the reductions `finalize_model_grads` would
do, the replicas' broadcast at start, and full gradients under Hugging Face names for comparisons."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist


def _needs_tp_sum(name: str, param: torch.nn.Parameter, config) -> bool:
    """Replicated parameters whose gradient is partial on each TP rank: norms under SP (each rank saw
    its share of the tokens) and q/k norms (each rank saw its share of the heads). The same rule as
    megatron's `_allreduce_non_tensor_model_parallel_grads`."""
    if getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False):
        return True
    return bool(getattr(config, "qk_layernorm", False)) and ("q_layernorm" in name or "k_layernorm" in name)


def finish_gradients(model: torch.nn.Module, config, data_parallel_mean: bool = False) -> None:
    """Reduce the partial gradients of replicated parameters after a backward pass.

    megatron's `finalize_model_grads` does this inside its DDP wrapper; verl training uses that.
    Our runs (CLI, demo, bench, tests) call the model without DDP, so they finish gradients here,
    the one place that does:
    - the replicas' sum: every gradient summed over the ranks that hold the same parameter and ran
      other tokens, the data-parallel-with-CP group, for expert weights (`allreduce=False`) the
      expert-data-parallel group (under EP x CP the data-parallel-with-CP group's CP ranks hold
      other experts). Megatron's schedule scales each CP rank's loss (its own shard's rows) by the
      CP size; that is divided out, so the gradient is that of the sum of every rank's loss (our
      losses are plain sums over samples: the whole batch's gradient). `data_parallel_mean` then
      divides by the data-parallel size, as megatron's DDP averages per-rank mean losses;
    - TP sum for SP norms and q/k norms, mean across TP for `average_gradients_across_tp_domain`
      parameters, the tied word-embedding sum between the first and last pipeline stage;
    - for MoE the routers' end of step (expert-bias update, token counts reset).
    """
    # imported here: heavy, loaded by the runs that reduce gradients, not on import
    from megatron.core import parallel_state

    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(dp_cp_group) > 1:
        expert_dp_group = parallel_state.get_expert_data_parallel_group()
        scale = parallel_state.get_context_parallel_world_size()
        if data_parallel_mean:
            scale *= parallel_state.get_data_parallel_world_size()
        for param in model.parameters():
            if param.grad is not None:
                group = dp_cp_group if getattr(param, "allreduce", True) else expert_dp_group
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(param.grad, group=group)
                if scale > 1:
                    param.grad /= scale

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
    # imported here: heavy (megatron's MoE layers): the routers' part of finalize_model_grads
    from ps_bridge.models.moe import finish_router_statistics

    finish_router_statistics(model, config)


def broadcast_replicas(model: torch.nn.Module) -> None:
    """Make the replicas of a randomly initialised model identical, as megatron's DDP wrapper
    broadcasts them at the start of training (`broadcast_params`): every parameter from rank 0 of
    the data-parallel-with-CP group (the CP replicas, and under expert parallelism the
    data-parallel ranks), expert weights (`allreduce=False`) over the expert data-parallel group
    (the ranks that hold the same experts); without expert parallelism the buffers too. Weights
    loaded from a checkpoint are identical already."""
    # imported here: heavy, loaded by the runs that reduce gradients, not on import
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return
    expert_group = parallel_state.get_expert_data_parallel_group()
    tensors = [(p.data, group if getattr(p, "allreduce", True) else expert_group) for p in model.parameters()]
    if parallel_state.get_expert_model_parallel_world_size() == 1:
        tensors += [(b, group) for b in model.buffers()]
    for tensor, g in tensors:
        if dist.get_world_size(g) > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(g, 0), group=g)


def hf_named_gradients(bridge, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full (unsharded) gradients under Hugging Face names, on every rank.

    Megatron-Bridge's export already knows how each parameter is split across TP ranks and PP
    stages (fused QKV, gated MLP halves, GDN heads), so the gradients are exported as if they were
    the weights: swap each parameter's data for its gradient, export, swap back. Every rank must
    call this (the export gathers across TP and PP).

    Some mappings are affine, not linear: Qwen3.5's GDN output norm is zero-centred in megatron and
    a plain scale in HF, so its export adds 1. The gradient is therefore export(grad) - export(0),
    both computed in float64 so that adding and removing the 1 loses nothing of a small gradient.

    A padded vocabulary (`configure_provider`) exports the embedding and output layer with their
    padded rows; those rows are cut, so every gradient has its HF parameter's shape.
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
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)  # the provider's: the true size
    out = {}
    for name, g in grads.items():
        g = (g - offsets[name]).float()
        if vocab and _is_vocab_parameter(name) and g.shape[0] > vocab:
            g = g[:vocab].clone()
        out[name] = g
    return out


def _is_vocab_parameter(hf_name: str) -> bool:
    """The HF embedding and LM head: the parameters a padded vocabulary pads."""
    return hf_name.endswith(("embed_tokens.weight", "lm_head.weight"))
