"""MoE load balancing under prefix sharing: prompt tokens count once per response.

Routing is token-wise, so every log-prob is exact whether a prompt is stored once or n times. What
changes is the *statistics* over tokens: the load-balancing auxiliary loss (Switch / global aux
loss) averages expert fractions `f_i` and router probabilities `P_i` over the tokens of the batch,
and the unshared batch holds each prompt token n times. `PrefixSharedTopKRouter` computes those sums
with a weight per token: `n` (the group size) for a prompt token, 1 for a response token, 0 for
padding. The shared run then gives the unshared run's aux loss value and gradient; the unshared run
itself (weights 1/0) gives megatron's own value whenever the pack has no padding (megatron counts
padding tokens, we do not: their routing is meaningless).

In megatron's per-token regime (`calculate_per_token_loss`, which Megatron-Bridge's Qwen3.5 VL provider
turns on under CP) megatron scales each rank's share of the loss by that rank's token count x the TP x
CP size, meant to be the micro-batch's token count; under CP the ranks' weighted counts differ (a prompt
token weighs n; padding weighs 0), so the router passes the TP/CP ranks' mean count instead (megatron's
own count wherever the ranks' counts are equal), and the gradient does not depend on how the pack's
tokens fall on the CP ranks.

The same weights make the router's other token statistics equal the unshared run's:
- the z-loss (`moe_z_loss_coeff`): the weighted mean of `logsumexp(logits)^2` over the tokens of the
  whole micro-batch (the weight total summed over the TP/CP ranks, each rank's share summed in
  backward), so value and gradients equal the unshared run's;
- the aux-loss-free expert-bias token counts (`moe_router_enable_expert_bias`): each routed token
  counts with its weight, so the per-expert counts, and the bias update megatron's
  `finalize_model_grads` makes from them (`finish_router_statistics` for runs without megatron's DDP),
  equal the unshared run's.

The weights travel with the micro-batch in `packed_seq_params.moe_token_weights`; megatron's
`MoELayer` is not handed `packed_seq_params`, so `PrefixSharedMoETransformerLayer` (megatron's
`TransformerLayer`, whose MLP step receives it) hands them to its MoE layer for that one call, and
`PrefixSharedMoELayer` sets them on its router around the routed computation and clears them after.
With MoE activation recompute (`recompute_granularity="selective"`, `recompute_modules=["moe"]`)
the router's statistics are computed when the layer is recomputed in the backward pass, which under
pipeline parallelism comes after other micro-batches' forwards: `PrefixSharedMoELayer` therefore
does that recompute itself, with the call's weights (and EP padding) bound to the recomputed
function, so a recomputed micro-batch reads its own weights. Covered: "aux_loss" and
"global_aux_loss" (Qwen3.5's), the z-loss, the expert-bias counts. Refused when active with prefix
sharing: "seq_aux_loss" (per-sequence statistics; a shared prompt belongs to n sequences).
Token dropping (`moe_expert_capacity_factor`) is refused by the provider: which tokens an expert
drops depends on the order and number of packed tokens, so it cannot equal the unshared run.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias, reset_model_temporary_tensors
from megatron.core.extensions.transformer_engine import te_checkpoint
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_moe_metrics_tracker,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from ps_bridge.models.token_permutation import use_gather_sum_permutation


class PrefixSharedTopKRouter(TopKRouter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token_weights: Optional[torch.Tensor] = None
        self.pad_rows = 0  # zero-weight rows PrefixSharedMoELayer appended for the EP allgather

    def _local_weights(self, num_local_tokens: int) -> torch.Tensor:
        w = self._unpadded_weights(num_local_tokens - self.pad_rows)
        return torch.cat([w, w.new_zeros(self.pad_rows)]) if self.pad_rows else w

    def _unpadded_weights(self, num_local_tokens: int) -> torch.Tensor:
        w = self.token_weights
        if w.numel() == num_local_tokens:
            return w
        # sequence parallelism: this rank routes its contiguous TP shard of the tokens the weights
        # cover (the packed tokens, or under context parallelism this CP rank's shard of them)
        size = dist.get_world_size(self.tp_group) if dist.is_initialized() else 1
        if self.config.sequence_parallel and w.numel() == num_local_tokens * size:
            return w.view(size, num_local_tokens)[dist.get_rank(self.tp_group)]
        raise ValueError(
            f"MoE router got {num_local_tokens} tokens but the prefix-shared token weights cover {w.numel()}"
        )

    def _weighted_loss(self, scores, routing_map, coeff, reduce_group, accumulate: bool):
        w = self._local_weights(routing_map.shape[0])
        local = (routing_map.to(torch.float32) * w[:, None]).sum(0)
        tokens_per_expert = reduce_from_tensor_model_parallel_region(local, reduce_group)
        total_tokens = tokens_per_expert.sum() / self.topk  # every token goes to topk experts
        if accumulate:  # global aux loss: running average over the micro-batches of a step
            self.global_tokens_per_expert += tokens_per_expert
            self.ga_steps += 1
            tokens_per_expert = self.global_tokens_per_expert / self.ga_steps
        loss = switch_load_balancing_loss_func(
            probs=scores * w[:, None],
            tokens_per_expert=tokens_per_expert,
            total_num_tokens=total_tokens,
            topk=self.topk,
            num_experts=self.config.num_moe_experts,
            moe_aux_loss_coeff=coeff,
            fused=False,
        )
        return loss, self._per_token_count(w)

    def _per_token_count(self, w: torch.Tensor) -> Optional[torch.Tensor]:
        """The `valid_token_count` megatron's `attach_and_log_load_balancing_loss` multiplies this
        rank's share of the loss by (with the TP x CP size) in the per-token regime: the mean over
        the TP/CP ranks of their weighted token counts, so that count x TP/CP size is the
        micro-batch's whole (unshared) token count on every rank. Megatron passes the rank's own
        count, which gives that only when all TP/CP ranks hold equal counts; a shared pack's CP
        shards do not (a prompt token weighs n), nor do the CP shards of a pack with padding, and
        the ranks' shares would then be scaled unequally. Outside that regime megatron does not read
        the count (and the all-reduce is skipped)."""
        if not self.calculate_per_token_loss:
            return None
        size = dist.get_world_size(self.tp_cp_group) if dist.is_initialized() else 1
        return self._weight_total(w) / size

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("aux_loss")
        if self.token_weights is None or coeff == 0:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        loss, valid = self._weighted_loss(scores_for_aux_loss, routing_map, coeff, self.tp_cp_group, False)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, loss, "load_balancing_loss", self.tp_cp_group, valid_token_count=valid
        )

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if self.token_weights is None or coeff == 0:
            return super()._apply_global_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        # the statistics span TP x DP x CP, the per-token count stays TP x CP's: megatron multiplies by
        # the TP x CP size, and the per-token trainer's divisor sums the DP ranks' micro-batch counts
        loss, valid = self._weighted_loss(scores_for_aux_loss, routing_map, coeff, self.tp_dp_cp_group, True)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, loss, "global_load_balancing_loss", self.tp_dp_cp_group, needs_dp_avg=False,
            valid_token_count=valid,
        )

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False):
        if self.token_weights is not None and self.get_aux_loss_coeff("seq_aux_loss") > 0:
            raise NotImplementedError(
                "the per-sequence MoE aux loss (seq_aux_loss) is not supported with prefix sharing; "
                "use aux_loss or global_aux_loss"
            )
        return super()._apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask)

    def _weight_total(self, w: torch.Tensor) -> torch.Tensor:
        """The micro-batch's total token weight (the unshared token count), over the TP/CP ranks."""
        total = w.sum().detach().clone()
        if dist.is_initialized() and dist.get_world_size(self.tp_cp_group) > 1:
            dist.all_reduce(total, group=self.tp_cp_group)
        return total

    def apply_z_loss(self, logits, padding_mask=None):
        coeff = self.config.moe_z_loss_coeff
        if self.token_weights is None or coeff is None or not self.training or not torch.is_grad_enabled():
            return super().apply_z_loss(logits, padding_mask)
        w = self._local_weights(logits.shape[0])
        total = self._weight_total(w)
        # this rank's share of coeff * sum_t w_t lse_t^2 / sum_t w_t; the TP/CP ranks' shares add up
        # in backward (megatron instead averages per-rank means, equal only for equal token counts)
        z_loss = coeff * (torch.logsumexp(logits, dim=-1).square() * w).sum() / total
        if self.calculate_per_token_loss:  # megatron's scaling with the unshared token count
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss * total)
        else:
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        size = dist.get_world_size(self.tp_cp_group) if dist.is_initialized() else 1
        # the tracker averages over TP x DP x CP: a rank's share times the TP/CP size averages to the total
        get_moe_metrics_tracker().record(
            "z_loss", z_loss.detach() * size / coeff, self.layer_number, self.config.num_layers,
            avg_group=self.tp_dp_cp_group,
        )
        return logits

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.token_weights is None or not (self.enable_expert_bias and torch.is_grad_enabled()):
            return super()._apply_expert_bias(routing_map, padding_mask)
        with torch.no_grad():  # each routed token counts with its weight (a prompt token n times)
            w = self._local_weights(routing_map.shape[0])
            self.local_tokens_per_expert += (routing_map.to(torch.float32) * w[:, None]).sum(0)


def check_moe_settings(config) -> None:
    """Refuse, by name, the MoE settings whose result prefix sharing cannot keep equal to the unshared run."""
    if getattr(config, "num_moe_experts", None) and getattr(config, "moe_expert_capacity_factor", None) is not None:
        raise ValueError(
            "MoE token dropping (moe_expert_capacity_factor="
            f"{config.moe_expert_capacity_factor}) is not supported with prefix sharing: an expert's capacity "
            "and which tokens it drops depend on the packed token count and order; set moe_expert_capacity_factor=None"
        )


def finish_router_statistics(model: torch.nn.Module, config) -> None:
    """What megatron's `finalize_model_grads` does for the routers at the end of a step, for runs
    without megatron's DDP wrapper: the expert-bias update from the step's token counts (summed over
    TP x DP x CP), then the counts and the global aux-loss trackers reset."""
    if getattr(config, "moe_router_enable_expert_bias", False):
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        _update_router_expert_bias([model], config, tp_dp_cp_group=group)
    if getattr(config, "num_moe_experts", None):
        reset_model_temporary_tensors(config, [model])


class PrefixSharedMoELayer(MoELayer):
    """megatron's `MoELayer`, with the call's MoE token weights on its router for exactly the
    routed computation of that call, recomputed or not.

    - The weights (handed over by `PrefixSharedMoETransformerLayer` through `call_token_weights`
      for the one call) are set on the router inside the function that runs the layer
      and cleared after it. With MoE recompute on (`recompute_granularity="selective"`,
      `"moe" in recompute_modules`) this layer checkpoints that function itself (megatron's own
      checkpoint inside `MoELayer.forward` is switched off), so the recompute in the backward pass
      binds the same weights: under pipeline parallelism it runs after later micro-batches'
      forwards, and a router state left from the last call would be another micro-batch's.
    - Under expert parallelism with the `allgather` dispatcher (used where CUDA is absent), whose
      all-gather needs the same token count on every TP x EP rank, it pads this rank's tokens with
      zero rows (zero weight in every router statistic) to the largest count and drops them from
      the output. Data-parallel ranks carry different micro-batches, so their packed lengths differ.
    - Its dispatcher permutes tokens with gathers and segmented sums instead of scatter-adds
      (`models/token_permutation.py`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        use_gather_sum_permutation(self.token_dispatcher)
        # the recompute of the whole MoE layer is done here, with the call's router inputs bound
        self.recompute_with_token_weights = self.moe_layer_recompute
        self.moe_layer_recompute = False
        self._call_weights: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def call_token_weights(self, weights: Optional[torch.Tensor]):
        """Hand `weights` to the next `forward`, inside the block only."""
        self._call_weights = weights
        try:
            yield
        finally:
            self._call_weights = None

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        weights = self._call_weights
        rows = hidden_states.shape[0]
        pad = self._allgather_pad(rows)  # a collective: once per call, never in the recompute
        if pad:
            hidden_states = torch.cat([hidden_states, hidden_states.new_zeros(pad, *hidden_states.shape[1:])])

        def routed(hidden, intermediate, mask):  # run in forward and again when recomputed
            self.router.token_weights, self.router.pad_rows = weights, pad
            try:
                return MoELayer.forward(self, hidden, intermediate, mask)
            finally:
                self.router.token_weights, self.router.pad_rows = None, 0

        if self.recompute_with_token_weights and self.training:
            if self.config.fp8 or self.config.fp4:
                result = te_checkpoint(
                    routed, False, tensor_parallel.random.get_cuda_rng_tracker, self.tp_group,
                    hidden_states, intermediate_tensors, padding_mask,
                )
            else:
                result = tensor_parallel.checkpoint(routed, False, hidden_states, intermediate_tensors, padding_mask)
        else:
            result = routed(hidden_states, intermediate_tensors, padding_mask)
        if not pad:
            return result
        output, bias = result
        return output[:rows], bias

    def _allgather_pad(self, rows: int) -> int:
        if self.config.moe_token_dispatcher_type != "allgather" or self.config.expert_model_parallel_size == 1:
            return 0
        group = self.token_dispatcher.tp_ep_group
        most = torch.tensor([rows], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        return int(most) - rows


class PrefixSharedMoETransformerLayer(TransformerLayer):
    """megatron's `TransformerLayer` that hands the micro-batch's MoE token weights to its MoE layer
    for the MLP step's call (a layer without a prefix-shared MoE layer is left alone). Nothing stays
    on the layer or its router after the call."""

    _call_packed_seq_params = None

    def forward(self, *args, **kwargs):
        # the call's `packed_seq_params`, kept for the MLP step and dropped when the call ends (not
        # every megatron-core hands it on to `_forward_mlp`: compat/megatron_core.py)
        self._call_packed_seq_params = kwargs.get("packed_seq_params")
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._call_packed_seq_params = None

    def _forward_mlp(self, hidden_states, *args, **kwargs):
        if not isinstance(self.mlp, PrefixSharedMoELayer):
            return super()._forward_mlp(hidden_states, *args, **kwargs)
        with self.mlp.call_token_weights(getattr(self._call_packed_seq_params, "moe_token_weights", None)):
            return super()._forward_mlp(hidden_states, *args, **kwargs)
