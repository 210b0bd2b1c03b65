"""Token permutation for megatron's MoE dispatchers without scatter-adds: gathers and segmented sums.

Without Transformer Engine megatron permutes tokens to experts with `index_select` (whose backward is
an `index_add_`) and restores them with a `scatter_add_` (`moe_utils.permute` / `unpermute`). On a
GPU both are atomic adds over every routed row: slow (bf16 atomics; on an H200 they were a quarter of
a Qwen3.5-35B-A3B MoE layer's forward + backward) and their summation order is not fixed.

Here the same two maps are written as a gather and its adjoint, a segmented sum. With
`sorted_indices` (megatron's permutation: routed row p holds token `sorted_indices[p]`), the
*bags* of a token are the routed rows holding it, in row order:
- permute   `y = x[sorted_indices]`                      backward `dx[t] = sum over t's bag of dy`
- unpermute `x[t] = sum over t's bag of y`  (combine)    backward `dy = dx[sorted_indices]`
The segmented sum is `torch.nn.functional.embedding_bag(mode="sum")` over the bags (one bag per
token, empty bags give 0), or, where every bag holds the same number of rows (top-k routing
permuted over all experts), a gather and a sum over the bag; both accumulate in float32 for bf16 in
a fixed order: deterministic and no less exact than the atomic adds they replace.

`GatherSumPermutation` plugs this into megatron's allgather and alltoall dispatchers (their own
permutation metadata, routing and communication are kept): the permutation is still megatron's
`permute`, run on detached tokens, with this module's backward attached; the combine is ours. It
steps aside (megatron's own path) wherever the dispatcher does something else with the tokens: TE's
fused permutation, token dropping with padding, padding for quantization, probabilities merged in the
unpermute, or a shared expert overlapped with the dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher


@dataclass
class TokenBags:
    """The routed rows of each token: `rows[offsets[t] : offsets[t+1]]` hold token t, in row order."""

    rows: torch.Tensor  # [routed rows] int64, routed row indices sorted by token (stable)
    offsets: torch.Tensor  # [num_tokens] int64, where each token's bag starts
    sorted_indices: torch.Tensor  # [routed rows] megatron's permutation: routed row -> token
    size: Optional[int] = None  # every bag holds exactly this many rows, or None


def token_bags(sorted_indices: torch.Tensor, num_tokens: int, size: Optional[int] = None) -> TokenBags:
    """No host sync (a GPU `bincount` would wait for its maximum): each bag starts where its token
    first appears among the rows sorted by token. `size`: every token has exactly that many rows (a
    top-k router's permutation over all experts: k each); checked on the device, without a host
    sync (a wrong size stops the run with a device-side assertion, never a wrong sum)."""
    idx = sorted_indices.long()
    rows = torch.argsort(idx, stable=True)
    tokens = torch.arange(num_tokens, device=idx.device, dtype=idx.dtype)
    offsets = torch.searchsorted(idx[rows], tokens)
    if size is not None:
        if idx.numel() != num_tokens * size:
            raise ValueError(f"{idx.numel()} routed rows are not {size} per token for {num_tokens} tokens")
        torch._assert_async((offsets == tokens * size).all(), f"MoE token bags are not {size} rows each")
    return TokenBags(rows=rows, offsets=offsets, sorted_indices=idx, size=size)


def bag_sum(values: torch.Tensor, bags: TokenBags) -> torch.Tensor:
    """`[num_tokens, H]`: each token's routed rows of `values [routed rows, H]` summed in a fixed
    order (no atomics), accumulated in float32 for bf16. Bags of one size: a gather and a sum over the bag (on an H200 at
    196K rows x 2048 a third faster than `embedding_bag`); else `embedding_bag`."""
    if bags.size is not None:
        return values.index_select(0, bags.rows).view(-1, bags.size, values.shape[-1]).sum(1)
    return F.embedding_bag(bags.rows, values, bags.offsets, mode="sum")


class _PermuteBackward(torch.autograd.Function):
    """Returns the already permuted `permuted = tokens[sorted_indices]` (computed without autograd)
    with the gradient to `tokens` as a segmented sum instead of an `index_add_`."""

    @staticmethod
    def forward(ctx, tokens, permuted, bags):
        ctx.bags = bags
        return permuted.view_as(permuted)

    @staticmethod
    def backward(ctx, grad):
        return bag_sum(grad.contiguous(), ctx.bags), None, None


class _Unpermute(torch.autograd.Function):
    """Routed rows back to tokens, summing each token's rows; backward gathers."""

    @staticmethod
    def forward(ctx, routed, bags):
        ctx.bags = bags
        return bag_sum(routed.contiguous(), bags)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.bags.sorted_indices), None


def permute_with_bags(tokens: torch.Tensor, permuted: torch.Tensor, bags: TokenBags) -> torch.Tensor:
    if not torch.is_grad_enabled() or not tokens.requires_grad:
        return permuted
    return _PermuteBackward.apply(tokens, permuted, bags)


def unpermute_with_bags(routed: torch.Tensor, bags: TokenBags) -> torch.Tensor:
    return _Unpermute.apply(routed, bags)


class GatherSumPermutation:
    """Mixin for megatron's allgather / alltoall token dispatchers: the permutation's backward and
    the combine as gathers and segmented sums (module docstring)."""

    def _gather_sum_applies(self) -> bool:
        c = self.config
        return not (
            c.moe_permute_fusion
            or getattr(self, "drop_and_pad", False)
            or getattr(c, "moe_router_padding_for_quantization", False)
            or getattr(self, "shared_experts", None) is not None
        )

    def _bag_size(self) -> Optional[int]:
        """Rows per token in this dispatcher's permutation, where every token has the same number:
        top-k routing permuted over all experts (the alltoall dispatcher always; the allgather one,
        which permutes to the local experts only, when they are all of them)."""
        if isinstance(self, MoEAlltoAllTokenDispatcher) or self.num_local_experts == self.config.num_moe_experts:
            return self.config.moe_router_topk
        return None

    def _permute(self, super_call, hidden_states, *args):
        """megatron's permuting method `super_call` on detached tokens, our backward attached."""
        if not self._gather_sum_applies():
            self._bags = None
            return super_call(hidden_states, *args)
        out = super_call(hidden_states.detach(), *args)
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        self._bags = token_bags(self.reversed_local_input_permutation_mapping, tokens.shape[0], self._bag_size())
        return (permute_with_bags(tokens, out[0], self._bags),) + tuple(out[1:])

    def _unpermute(self, routed: torch.Tensor) -> torch.Tensor:
        out = unpermute_with_bags(routed, self._bags)
        self._bags = None
        return out.view(self.hidden_shape_before_permute)


class GatherSumAllGatherTokenDispatcher(GatherSumPermutation, MoEAllGatherTokenDispatcher):
    """megatron's allgather dispatcher (used where CUDA is absent) with gather-sum permutation."""

    def dispatch_postprocess(self, hidden_states, probs):
        return self._permute(super().dispatch_postprocess, hidden_states, probs)

    def combine_preprocess(self, hidden_states):
        if getattr(self, "_bags", None) is None:
            return super().combine_preprocess(hidden_states)
        return self._unpermute(hidden_states)


class GatherSumAlltoAllTokenDispatcher(GatherSumPermutation, MoEAlltoAllTokenDispatcher):
    """megatron's alltoall dispatcher (used on the GPU) with gather-sum permutation. With one
    source rank (EP = TP = 1) its second permutation, the sort of token chunks by local expert, is
    the identity (a split into 256 chunks and a copy of every routed row, forward and backward):
    skipped. Then nothing needs the token counts on the host (no communication splits, no chunk
    sizes), so they go to the experts as the device tensor megatron computed, without megatron's
    wait for their host copy: experts that need host counts (`SequentialMLP`, TE's grouped
    linears) move them there themselves; ours (`models/experts.py`) do not, so the layer runs
    without a host sync."""

    def preprocess(self, routing_map):
        counts = super().preprocess(routing_map)
        self._device_tokens_per_expert = counts  # before megatron replaces it with its host copy
        return counts

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        return self._permute(super().dispatch_preprocess, hidden_states, routing_map, probs)

    def _chunk_sort_is_identity(self) -> bool:
        """Fixed by the dispatcher's settings: decided on the first call and kept."""
        known = self.__dict__.get("_identity_chunk_sort")
        if known is None:
            order = self.sort_input_by_local_experts
            known = (self.tp_size * self.ep_size == 1 and not self.drop_and_pad and self._gather_sum_applies()
                     and torch.equal(order.cpu(), torch.arange(order.numel())))
            self._identity_chunk_sort = known
        return known

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        tokens_per_expert, self._device_tokens_per_expert = self._device_tokens_per_expert, None
        if not self._chunk_sort_is_identity():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        self.tokens_per_expert = None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if not self._chunk_sort_is_identity():
            return super().combine_preprocess(hidden_states)
        return hidden_states  # TP = 1: no reduce-scatter either

    def combine_postprocess(self, permutated_local_input_tokens):
        if getattr(self, "_bags", None) is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        return self._unpermute(permutated_local_input_tokens).view(self.hidden_shape)


GATHER_SUM_DISPATCHERS = {
    MoEAllGatherTokenDispatcher: GatherSumAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher: GatherSumAlltoAllTokenDispatcher,
}


def use_gather_sum_permutation(dispatcher) -> None:
    """Give megatron's dispatcher (built inside `MoELayer.__init__` from the config's dispatcher
    type, with no spec hook) the gather-sum permutation by switching it to our subclass, which adds
    methods only. Other dispatcher types (flex) are left as they are."""
    cls = GATHER_SUM_DISPATCHERS.get(type(dispatcher))
    if cls is not None:
        dispatcher.__class__ = cls


def use_megatron_permutation(dispatcher) -> None:
    """The inverse: back to megatron's own dispatcher class (to compare with or time it)."""
    stock = {ours: theirs for theirs, ours in GATHER_SUM_DISPATCHERS.items()}.get(type(dispatcher))
    if stock is not None:
        dispatcher.__class__ = stock
