"""`flash_atten_gpu_expand`: prefix-shared attention as one bottom-right causal varlen flash call.

A response's queries attend to the gathered keys/values `[prompt (valid tokens); response]`; a
prompt's queries to the prompt itself (with `Lq == Lk`, bottom-right causal is plain causal). Simple,
one kernel launch, but it copies each prompt's key/value once per response (2 * n * P * Hkv * D
elements per layer). The gather (`ExpandPlan.key_rows`) is also what `flash_atten_npu` runs on.

Kernels come from ps_bridge.kernels.attention.varlen, as for the cascade.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from ps_bridge.kernels.attention.kernel_choice import kernel_for
from ps_bridge.kernels.attention.varlen import PlannedAttention, VarlenCall, check_shapes
from ps_bridge.layout import PackedPrefixLayout


@dataclass
class ExpandPlan:
    call: VarlenCall  # bottom-right causal, queries = the pack, keys = the gathered rows
    key_rows_host: List[int]  # packed position of each gathered key row

    def forward(self, q, k_rows, v_rows, scale, kernel):
        return kernel.forward(q, k_rows, v_rows, self.call, scale)

    def backward(self, dout, q, k_rows, v_rows, out, lse, scale, kernel, aux):
        return kernel.backward(dout, q, k_rows, v_rows, out, lse, self.call, scale, aux)

    def key_rows(self, device) -> torch.Tensor:
        device = torch.device(device)
        cached = self.__dict__.setdefault("_rows", {})
        if device not in cached:
            cached[device] = torch.tensor(self.key_rows_host, dtype=torch.long, device=device)
        return cached[device]


def expand_plan(layout: PackedPrefixLayout) -> ExpandPlan:
    return layout.derived("flash_expand_plan", lambda: _build_expand_plan(layout))


def _build_expand_plan(layout: PackedPrefixLayout) -> ExpandPlan:
    host = layout.host
    offsets = host["cu_seqlens_padded"]
    rows: List[int] = []
    cu_k = [0]
    for s in range(len(offsets) - 1):
        if not host["segment_is_prompt"][s]:
            p = host["segment_group"][s]  # group g's prompt is segment g
            rows.extend(range(offsets[p], offsets[p] + host["valid_lengths"][p]))
        rows.extend(range(offsets[s], offsets[s + 1]))
        cu_k.append(len(rows))
    return ExpandPlan(call=VarlenCall(cu_q=list(offsets), cu_k=cu_k, causal=True), key_rows_host=rows)


def prefix_shared_attention_expand(q, k, v, layout: PackedPrefixLayout, softmax_scale: float) -> torch.Tensor:
    check_shapes(q, k, v, layout)
    plan = expand_plan(layout)
    rows = plan.key_rows(q.device)
    # index_select's backward scatters (sums) the gathered rows' gradients back onto the pack
    k_rows, v_rows = k.index_select(0, rows), v.index_select(0, rows)
    return PlannedAttention.apply(q, k_rows, v_rows, plan, float(softmax_scale), kernel_for(q.device))
