"""The one call of a prefix-aware model on a packed micro-batch.

The CLI, the schedule (and so every parallel layout), the bench and the verl engine all run the
model through `run_packed`: the layout's tokens and per-token positions as one THD sequence, and
`PrefixSharedPackedSeqParams` carrying the layout, the attention backend and (derived on demand)
the MoE token weights. What comes back is megatron's output for this pipeline stage: the packed
logits `[1, T, V / tp]` on the last stage, hidden states on the others. Under context parallelism
every CP rank runs its own contiguous shard of the pack (`PackedPrefixLayout.cp_shard`) and gets the
logits / hidden states of that shard; the layout in `packed_seq_params` stays the whole pack's.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.cuda_graphs import graphed, without_data_parallel
from ps_bridge.layout import PackedPrefixLayout
from ps_bridge.models.context_parallel import cp_rank_size
from ps_bridge.models.packed_seq import PrefixSharedPackedSeqParams


def local_shard(layout: PackedPrefixLayout) -> Optional[slice]:
    """The packed positions this process runs: its context-parallel shard, or None (all) without CP."""
    cp_rank, cp_size = cp_rank_size()
    return layout.cp_shard(cp_rank, cp_size) if cp_size > 1 else None


def cp_total_multiple() -> int:
    """What the whole pack is padded to a multiple of: under context parallelism 2 x TP x CP (equal
    contiguous CP shards, each split evenly by sequence parallelism and in two halves by megatron's
    THD RoPE under CP, `models/gpt_model.py`); 1 without CP."""
    _, cp_size = cp_rank_size()
    if cp_size == 1:
        return 1
    return 2 * parallel_state.get_tensor_model_parallel_world_size() * cp_size


def shard_tag(layout: PackedPrefixLayout) -> str:
    """` cp_shard=[a, b) of T` for the `[PS][prepare]` layout line under CP; empty without."""
    shard = local_shard(layout)
    return "" if shard is None else f" cp_shard=[{shard.start}, {shard.stop}) of {layout.num_tokens}"


def run_packed(model: torch.nn.Module, layout: PackedPrefixLayout, config: PrefixSharingConfig) -> torch.Tensor:
    """`model` (megatron's module, wrapped or not) on the packed sequence of `layout` (on the model's
    device), with `config.backend` as the softmax-attention backend. With `config.cuda_graphs` the
    model up to its output layer (and its backward) replays CUDA graphs where they were captured for the
    layout's structure, and the output layer runs eagerly (`ps_bridge.cuda_graphs.graphed`)."""
    if config.cuda_graphs:
        return graphed(model, layout, config.backend,
                       lambda own, weights, **kwargs: _run(model, own, config, weights, **kwargs),
                       memory_share=config.cuda_graph_memory)
    return _run(model, layout, config)


def _run(model: torch.nn.Module, layout: PackedPrefixLayout, config: PrefixSharingConfig,
         weights: Optional[dict] = None, hidden_states_only: bool = False, **module_kwargs) -> torch.Tensor:
    """The model's call; with `weights` (parameter name -> tensor, names of `without_data_parallel(model)`)
    in place of its parameters; `hidden_states_only`: the model stops before its output layer
    (`SelectedOutputsMixin`); `module_kwargs` go to the module (megatron's Float16Module takes
    `fp32_output`)."""
    shard = local_shard(layout)
    params = PrefixSharedPackedSeqParams.from_layout(layout, attention_backend=config.backend, cp_shard=shard,
                                                     hidden_states_only=hidden_states_only)
    tokens = layout.tokens if shard is None else layout.tokens[shard]
    inputs = dict(
        input_ids=tokens.unsqueeze(0),
        position_ids=params.local_positions.unsqueeze(0),
        attention_mask=None,
        packed_seq_params=params,
        **module_kwargs,
    )
    if weights is not None:
        return torch.func.functional_call(without_data_parallel(model), weights, args=(), kwargs=inputs)
    return model(**inputs)
