"""Grouped MoE experts without Transformer Engine: grouped linear layers for megatron's `TEGroupedMLP`.

megatron's `TEGroupedMLP` runs all local experts of a layer with two grouped linear layers (fc1, fc2)
that it builds through the `GroupedLinearFc1Builder` / `GroupedLinearFc2Builder` protocols of
`megatron/core/transformer/moe/experts.py`; megatron only ships TE's. `GroupedMMColumnLinear` (fc1)
and `GroupedMMRowLinear` (fc2) follow those protocols on torch's grouped matrix multiply:

- parameters in TE's grouped layout, one `[out, in]` matrix per local expert named `weight0..N`
  (`experts.linear_fc1.weight<i>`), which Megatron-Bridge's Qwen3.5 MoE mapping converts;
- `forward(x [T, in], tokens_per_expert)` with the tokens sorted by expert (megatron's dispatcher
  does that): in bfloat16/float16 one `torch.nn.functional.grouped_mm` call over all experts
  (forward, and two in backward: input and weight gradients), int32 cumulative offsets; in any
  other dtype (float32: `grouped_mm` has no float32 path on the CPU) an exact per-expert loop;
- the experts' matrices live in one buffer, so grouped_mm reads them as a stacked view with no copy
  (a stacked copy of a 256-expert layer's weights was an eighth of its forward + backward on an
  H200); where parameters were re-laid out (megatron's DDP buckets) each run of back-to-back
  experts gets its own grouped_mm call;
- no communication, as TE's expert linears under megatron's explicit expert communication: the
  token dispatcher does the expert TP / EP exchange; the shapes are this rank's expert-TP shard.

`GroupedMMExperts` is megatron's `TEGroupedMLP` built on them; in the common SwiGLU case its forward
keeps the token counts on the device (no host sync per layer) and runs the probability-weighted
SwiGLU as one fused kernel on CUDA (`ps_bridge/kernels/weighted_swiglu.py`). Where real TE is
installed `grouped_experts_spec()` returns megatron's own `TEGroupedMLP` with TE's grouped linears.
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Sequence, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import HAVE_TE, GroupedMLPSubmodules, TEGroupedMLP
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from ps_bridge.compat import megatron_core as compat_megatron_core
from ps_bridge.compat.torch import grouped_mm
from ps_bridge.kernels.weighted_swiglu import weighted_swiglu


def uses_grouped_mm(x: torch.Tensor) -> bool:
    """One grouped_mm call for this input (bf16/fp16), else the exact per-expert loop (float32, float64)."""
    return x.dtype in (torch.bfloat16, torch.float16)


def weight_spans(weights: Sequence[torch.Tensor]) -> List[Tuple[int, int]]:
    """The maximal runs `(first, end)` of experts whose `[out, in]` matrices lie back to back in one
    storage. The layer allocates all its experts in one buffer (one run); megatron's DDP may re-lay
    parameters into its buckets, which can cut them into a few runs."""
    spans, first = [], 0
    for i in range(1, len(weights) + 1):
        if i == len(weights) or not _follows(weights[i - 1], weights[i]):
            spans.append((first, i))
            first = i
    return spans


def stacked(weights: Sequence[torch.Tensor], first: int, end: int) -> torch.Tensor:
    """`[end-first, out, in]` of one span of `weight_spans`: a view (no copy) of contiguous matrices."""
    w0 = weights[first]
    if not w0.is_contiguous():  # a span of one matrix that is not contiguous
        return w0.contiguous().unsqueeze(0)
    step = w0.numel()
    return w0.as_strided((end - first, *w0.shape), (step, w0.shape[1], 1))


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.is_contiguous() and b.is_contiguous() and a.shape == b.shape and a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.storage_offset() == a.storage_offset() + a.numel()
    )


class _GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ W_e^T with one grouped_mm call per run of experts stored back to
    back (one run for the layer as built). Each run's token rows and int32 offsets are made once in
    forward and kept for backward; the stacked weight views are rebuilt there rather than kept."""

    @staticmethod
    def forward(ctx, x, tokens_per_expert, spans, *weights):
        plan = _run_plan(tokens_per_expert, spans, x.device)
        ctx.save_for_backward(x, *weights)
        ctx.plan = plan
        outs = [grouped_mm()(x[rows], stacked(weights, first, end).transpose(-2, -1), offs=offs)
                for first, end, rows, offs in plan]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def backward(ctx, grad_out):
        x, *weights = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        whole = len(ctx.plan) == 1 and ctx.plan[0][2] == _ALL_ROWS
        grad_x = None
        if ctx.needs_input_grad[0] and not whole:
            grad_x = torch.empty_like(x)
        grads_w = [None] * len(weights)
        want_w = any(ctx.needs_input_grad[3:])
        for first, end, rows, offs in ctx.plan:
            g = grad_out[rows]
            if ctx.needs_input_grad[0]:
                gx = grouped_mm()(g, stacked(weights, first, end), offs=offs)
                if whole:
                    grad_x = gx  # one run over every row: no copy into a second buffer
                else:
                    grad_x[rows] = gx
            if want_w:
                # [E, out, in]: per expert grad_out_e^T @ x_e, grouped along the token dimension
                grads_w[first:end] = grouped_mm()(g.t(), x[rows], offs=offs).unbind(0)
        return (grad_x, None, None, *grads_w)


_ALL_ROWS = slice(None)


def _run_plan(tokens_per_expert, spans, device):
    """For each span `(first, end)`: its experts' slice of token rows and their int32 cumulative
    row ends (grouped_mm's `offs`).

    `tokens_per_expert` is a list, or a tensor on the host or on `device`. With one span (the layer
    as built) the offsets are a cumulative sum where the counts are, so counts on the device need no
    host sync (megatron's dispatcher hands them over that way, `models/token_permutation.py`);
    several spans need the counts on the host to slice the rows."""
    if len(spans) == 1:
        counts = tokens_per_expert if torch.is_tensor(tokens_per_expert) else torch.tensor(tokens_per_expert)
        first, end = spans[0]
        return [(first, end, _ALL_ROWS, _on(device, torch.cumsum(counts, 0, dtype=torch.int32)))]
    starts = [0]
    for c in _counts(tokens_per_expert):
        starts.append(starts[-1] + c)
    ends = _on(device, torch.tensor(starts[1:], dtype=torch.int32))  # one host-to-device copy
    return [(first, end, slice(starts[first], starts[end]), ends[first:end] - starts[first]) for first, end in spans]


def _on(device, t: torch.Tensor) -> torch.Tensor:
    """`t` on `device`; a host tensor goes to a GPU from pinned memory, which does not wait for the stream."""
    if t.device == device:
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _counts(tokens_per_expert) -> List[int]:
    if torch.is_tensor(tokens_per_expert):
        return tokens_per_expert.tolist()  # one call, not one 0-dim tensor per expert
    return [int(c) for c in tokens_per_expert]


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], tokens_per_expert,
                   spans: Optional[List[Tuple[int, int]]] = None) -> torch.Tensor:
    """`x [T, in]` sorted by expert (`tokens_per_expert[e]` rows each, a list or a tensor; on the
    device it stays there in the grouped path) times each expert's `[out, in]`; `spans`:
    `weight_spans(weights)` where the caller keeps it."""
    if uses_grouped_mm(x):
        spans = weight_spans(weights) if spans is None else spans
        if not torch.is_tensor(tokens_per_expert):
            tokens_per_expert = _counts(tokens_per_expert)
        return _GroupedLinear.apply(x.contiguous(), tokens_per_expert, spans, *weights)
    chunks = torch.split(x, _counts(tokens_per_expert))
    return torch.cat([chunk @ w.t() for chunk, w in zip(chunks, weights)])


class _GroupedMMLinear(MegatronModule):
    """One grouped linear layer of `TEGroupedMLP` (builder protocol arguments; bias not supported)."""

    partition_dim: int  # 0: the output is split over expert TP (fc1), 1: the input (fc2)

    def __init__(
        self,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        /,
        *,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection=None,
        name: Optional[str] = None,
    ):
        super().__init__(config=config)
        if bias:
            raise ValueError(
                "grouped experts without Transformer Engine have no bias: set add_bias_linear=False "
                "or moe_grouped_gemm=False (SequentialMLP)"
            )
        tp = pg_collection.expt_tp.size() if pg_collection is not None and pg_collection.expt_tp is not None else 1
        ep = pg_collection.ep.size() if pg_collection is not None and pg_collection.ep is not None else 1
        shape = [output_size, input_size]
        if shape[self.partition_dim] % tp:
            raise ValueError(f"expert TP size {tp} does not divide the expert width {shape[self.partition_dim]}")
        shape[self.partition_dim] //= tp
        self.num_gemms = num_local_experts
        # for the sharded checkpoint (`sharded_state_dict`): the expert TP / EP / expert-DP groups
        self._ckpt_groups = None if pg_collection is None else (pg_collection.expt_tp, pg_collection.ep,
                                                                pg_collection.expt_dp)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        # all experts in one buffer, so grouped_mm reads them as one stacked view (`weight_spans`).
        # Registered last expert first: megatron's DDP lays a module's parameters into its buffer in
        # reverse registration order, which keeps the experts ascending there too.
        buffer = torch.empty([num_local_experts, *shape], dtype=config.params_dtype, device=device)
        weights = [torch.nn.Parameter(buffer[i]) for i in range(num_local_experts)]
        for w in weights:
            if config.perform_initialization:
                init_method(w)
            set_tensor_model_parallel_attributes(w, is_parallel=tp > 1, dim=self.partition_dim, stride=1)
            # as megatron's expert linears: expert weights are reduced over the expert data-parallel group
            setattr(w, "allreduce", not (is_expert and ep > 1))
        for i in reversed(range(num_local_experts)):
            self.register_parameter(f"weight{i}", weights[i])
        # a sharded checkpoint carries one (empty) `_extra_state` object per expert, as TE's grouped
        # linears and megatron's SequentialMLP save; this layer has none to restore
        self._register_load_state_dict_pre_hook(_drop_extra_states)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """What TE's grouped linears save (megatron's `TEGroupedLinear._sharded_state_dict_grouped`),
        so that `TEGroupedMLP.sharded_state_dict` gives megatron's `SequentialMLP` checkpoint keys: per
        local expert `i` its `[out, in]` matrix under the key `{prefix}weight` with an expert axis in
        front (offset: the expert's global index among EP x local experts), split over expert TP on
        `partition_dim`, and an empty `_extra_state` object; replicas counted over expert-DP."""
        return grouped_expert_sharded_state_dict(
            self.weights(), self.partition_dim, self._ckpt_groups, prefix, sharded_offsets, metadata
        )

    def weights(self):
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def spans(self, weights) -> List[Tuple[int, int]]:
        """`weight_spans` of this layer's experts, recomputed only when a matrix has moved (checking
        the spans costs milliseconds of host time per call at 256 experts; the pointers do not)."""
        key = tuple(w.data_ptr() for w in weights)
        if getattr(self, "_spans_key", None) != key:
            self._spans_key, self._spans = key, weight_spans(weights)
        return self._spans

    def forward(self, x: torch.Tensor, tokens_per_expert):
        weights = self.weights()
        spans = self.spans(weights) if uses_grouped_mm(x) else None
        return grouped_linear(x, weights, tokens_per_expert, spans), None

    def backward_dw(self) -> None:  # no delayed weight gradients
        return None


def _drop_extra_states(state_dict, prefix, *args, **kwargs):
    for key in [k for k in state_dict if k.startswith(f"{prefix}_extra_state")]:
        del state_dict[key]


def grouped_expert_sharded_state_dict(weights, partition_dim, groups, prefix, sharded_offsets, metadata):
    """The sharded state dict of one grouped expert linear (see `_GroupedMMLinear.sharded_state_dict`).
    `groups`: (expert TP, EP, expert DP) process groups, or None for megatron's global ones."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    if groups is None:
        groups = (parallel_state.get_expert_tensor_parallel_group(), parallel_state.get_expert_model_parallel_group(),
                  parallel_state.get_expert_data_parallel_group())
    tp_group, ep_group, edp_group = groups
    singleton_local_shards = metadata.get("singleton_local_shards", False)
    num_local = len(weights)
    first_global = ep_group.rank() * num_local
    num_global = ep_group.size() * num_local
    out = {}
    for i, weight in enumerate(weights):
        global_index = first_global + i
        if singleton_local_shards:
            expert_prefix, offsets = f"{global_index}.{prefix}", sharded_offsets
        else:
            expert_prefix = prefix
            offsets = (*sharded_offsets, (len(sharded_offsets), global_index, num_global))
        sub = make_sharded_tensors_for_checkpoint(
            {f"{i}.weight": weight, f"{i}._extra_state": None}, "", {f"{i}.weight": partition_dim}, offsets,
            tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"],
        )
        replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
        out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
        out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
    for sh in out.values():  # expert weights are replicated over the expert-data-parallel ranks only
        assert len(sh.replica_id) == 3, sh.replica_id
        sh.replica_id = (*sh.replica_id[:2], edp_group.rank())
    return out


class GroupedMMColumnLinear(_GroupedMMLinear):
    """fc1 of the grouped experts (output split over expert TP)."""

    partition_dim = 0


class GroupedMMRowLinear(_GroupedMMLinear):
    """fc2 of the grouped experts (input split over expert TP)."""

    partition_dim = 1


class GroupedMMExperts(TEGroupedMLP):
    """megatron's `TEGroupedMLP` on our grouped linears. In its plain case (SwiGLU; no quantization,
    no activation offloading or recompute, no GLU interleaving or clamping) the forward is
    fc1 -> `weighted_swiglu` -> fc2, with the token counts left where the dispatcher put them:
    grouped_mm takes device offsets, so counts on the device need no host sync, where
    `TEGroupedMLP.forward` first moves them to the host (`.tolist()`, TE's GEMMs need host
    splits). Every other case is megatron's forward."""

    def _plain(self) -> bool:
        c = self.config
        return (
            c.gated_linear_unit and self.activation_func is torch.nn.functional.silu
            and not (c.fp8 or c.fp4 or c.moe_apply_probs_on_input or c.use_te_activation_func)
            and c.moe_mlp_glu_interleave_size is None and c.activation_func_clamp_value is None
            and not c.glu_linear_offset
            and not (self.activation_recompute or self.offload_expert_fc1 or self.offload_moe_act
                     or compat_megatron_core.offloads_fused_group_mlp(self) or self._with_fused_impl)
        )

    def forward(self, hidden, tokens_per_expert, permuted_probs, **output_buffers):
        """`output_buffers`: what megatron's MoE layer passes by keyword beyond the three inputs (the
        zero-copy `output_buffer` / `grad_input_buffer`, `compat/megatron_core.py`): with any set,
        megatron's own forward, which writes into them."""
        if any(b is not None for b in output_buffers.values()):
            return super().forward(hidden, tokens_per_expert, permuted_probs, **output_buffers)
        if not self._plain():
            return super().forward(hidden, tokens_per_expert, permuted_probs)
        h, _ = self.linear_fc1(hidden, tokens_per_expert)
        out, _ = self.linear_fc2(weighted_swiglu(h, permuted_probs), tokens_per_expert)
        return out, None


def grouped_experts_spec():
    """megatron's `TEGroupedMLP` with TE's grouped linears where TE is installed, else ours."""
    if HAVE_TE:  # megatron-core found real TE (not our import placeholder); not run here: no TE on our machines
        # imported here: Transformer Engine's grouped linears, real classes only where TE is installed (else None)
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )

        return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear))
    return partial(GroupedMMExperts, submodules=GroupedMLPSubmodules(
        linear_fc1=GroupedMMColumnLinear, linear_fc2=GroupedMMRowLinear))
