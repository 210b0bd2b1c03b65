"""Micro-batches of samples through megatron's forward-backward schedule, prefix-shared.

This is how a training engine runs the model (verl's Megatron engine calls the same
`get_forward_backward_func()`), and the only way to run physical pipeline parallelism: every stage
gets every micro-batch, builds the same packed layout from its samples (deterministic, a few
host-side lists), and hands it to the model in `packed_seq_params`, so each stage's attention sees
the layout of the activations it receives. Micro-batches pack to different lengths; megatron's
`variable_seq_lengths` makes neighbouring stages exchange shapes first. The last stage turns the
logits into log-probs (vocabulary-parallel at TP > 1) and, for a backward pass, the loss
`sum_i sum_j w_ij * logp_ij` over every micro-batch. Under context parallelism each CP rank runs
its shard of every micro-batch; its loss covers the rows of its shard, the gradients are completed
over the CP group (`finish_gradients`, which also sums them over data-parallel ranks), and the
reported log-probs are the rows summed over it.
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from ps_bridge.forward import local_shard, run_packed
from ps_bridge.layout import Sample
from ps_bridge.parallel.gradients import finish_gradients
from ps_bridge.rows import PackedRows
from ps_bridge.tools.runtime import LoadedModel, make_layout

LogProbs = List[torch.Tensor]  # one tensor per sample: log-probs of its response tokens


def logprob_pass(
    loaded: LoadedModel,
    micro_batches: Sequence[Sequence[Sample]],
    share: Optional[bool] = None,
    loss_weights: Optional[Sequence[Sequence[torch.Tensor]]] = None,
) -> List[LogProbs]:
    """Response log-probs of every sample of every micro-batch, float32 on the CPU, on every rank.

    With `loss_weights` (one tensor per sample, one weight per response token) it also runs the
    backward pass of `sum w * logp` over all micro-batches and finishes the gradients (TP and
    pipeline reductions), so each rank's `.grad` holds its shard of the full gradient.
    """
    if len(micro_batches) == 0:
        raise ValueError("logprob_pass needs at least one micro-batch")
    backward = loss_weights is not None
    if backward and len(loss_weights) != len(micro_batches):
        raise ValueError(f"{len(loss_weights)} sets of loss weights for {len(micro_batches)} micro-batches")
    items = [(list(mb), None if not backward else list(loss_weights[i])) for i, mb in enumerate(micro_batches)]
    step = partial(_forward_step, loaded, share, len(items))
    store = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(items),
        model=[loaded.model],
        num_microbatches=len(items),
        seq_length=1,  # unused: variable_seq_lengths exchanges each micro-batch's shape
        micro_batch_size=1,
        forward_only=not backward,
    )
    if backward:
        finish_gradients(loaded.model, loaded.provider)
    return _from_last_stage([out["logprobs"] for out in store])


def _forward_step(loaded: LoadedModel, share, num_microbatches: int, data_iterator, model):
    samples, weights = next(data_iterator)
    layout = make_layout(samples, loaded, share=share).to(loaded.device)
    output = run_packed(model, layout, loaded.config)
    rows = PackedRows.of(layout, cp_shard=local_shard(layout))
    return output, partial(_logprob_loss, rows, weights, num_microbatches, loaded.tp > 1)


def _logprob_loss(rows: PackedRows, weights, num_microbatches: int, vocab_parallel: bool, logits):
    own = rows.logprobs(logits, vocab_parallel=vocab_parallel)  # this CP rank's rows (all without CP)
    per_sample = rows.responses(own)
    if weights is None:
        loss = logits.sum() * 0.0
    else:
        loss = sum((w.to(lp.device) * lp).sum() for w, lp in zip(weights, per_sample))
    # megatron divides a (loss, data) loss by the number of micro-batches; undo it so the
    # gradients are those of the plain sum over micro-batches (its CP scaling is divided out in
    # `finish_gradients`)
    full = rows.responses(rows.complete(own))
    return loss * num_microbatches, {"logprobs": [lp.detach().float().cpu() for lp in full]}


def _from_last_stage(logprobs: List[LogProbs]) -> List[LogProbs]:
    """The last pipeline stage computed the log-probs; give them to every stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return logprobs
    group = parallel_state.get_pipeline_model_parallel_group()
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    box = [logprobs if parallel_state.is_pipeline_last_stage() else None]
    dist.broadcast_object_list(box, src=last, group=group)
    return box[0]
