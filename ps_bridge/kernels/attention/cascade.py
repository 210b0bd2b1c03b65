"""`flash_atten_gpu`: prefix-shared attention as a cascade of varlen flash calls, copying no key/value.

It runs on the packed layout of ps_bridge.layout: all prompt segments first (the *prompt block*),
then the responses group by group (the *response block*), each segment padded at its end.

  1. one causal call over every segment of the pack, with the padded segment offsets: a prompt
     token sees its prompt causally, a response token its own response causally (padding sits at
     segment ends, so no valid query ever sees it);
  2. one non-causal call of the response block's queries against their prompt's keys, one batch
     element per group: the queries of all responses of group g are contiguous, and so are the keys
     of prompt g. Prompt padding is skipped with an extra batch element that has keys and no
     queries, so neither a copy nor a `seqused_k` (which torch's backward lacks) is needed;
  3. the two partial results of each response token are merged by their log-sum-exp.
  Backward: each partial's flash backward is run with the *merged* output and log-sum-exp and the
  gradients are summed. That is exact: a flash backward rebuilds the probabilities as
  exp(scores - lse) and the row term from (dout * out), so with the merged values each call yields
  its share of the true gradient, and no gradient through the log-sum-exp is needed.

Kernels come from ps_bridge.kernels.attention.varlen: flash-attn if installed, else torch's own
CUDA flash kernels; on a CPU torch's CPU flash op (slow, used by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ps_bridge.kernels.attention.varlen import PlannedAttention, VarlenCall, VarlenKernel, check_shapes, kernel_for
from ps_bridge.layout import PackedPrefixLayout


@dataclass
class CascadePlan:
    segments: VarlenCall  # causal, every segment of the pack
    cross: Optional[VarlenCall]  # response block's queries vs prompt block's keys; None without responses
    prompt_block_end: int

    def forward(self, q, k, v, scale, kernel):
        return cascade_forward(q, k, v, self, scale, kernel)

    def backward(self, dout, q, k, v, out, lse, scale, kernel, aux):
        return cascade_backward(dout, q, k, v, out, lse, self, scale, kernel, aux)


def cascade_plan(layout: PackedPrefixLayout) -> CascadePlan:
    # derived from host metadata only: built once per layout, for every layer
    return layout.derived("flash_cascade_plan", lambda: _build_cascade_plan(layout))


def _build_cascade_plan(layout: PackedPrefixLayout) -> CascadePlan:
    host = layout.host
    offsets = host["cu_seqlens_padded"]
    seg_group = host["segment_group"]
    num_prompts = layout.num_prompt_segments
    segments = VarlenCall(cu_q=list(offsets), cu_k=list(offsets), causal=True)
    block_end = offsets[num_prompts]
    cross = None
    if len(offsets) - 1 > num_prompts:
        # response range of each group inside the response block (responses are stored group by group)
        first: dict = {}
        last: dict = {}
        for s in range(num_prompts, len(offsets) - 1):
            g = seg_group[s]
            first.setdefault(g, offsets[s] - block_end)
            last[g] = offsets[s + 1] - block_end
        cu_q: List[int] = [0]
        cu_k: List[int] = [0]
        for p in range(num_prompts):
            g = seg_group[p]
            q_start, q_end = (first[g], last[g]) if g in first else (cu_q[-1], cu_q[-1])
            if q_start != cu_q[-1]:
                raise AssertionError("response block is not stored group by group in prompt order")
            valid_end = offsets[p] + host["valid_lengths"][p]
            cu_q.append(q_end)
            cu_k.append(valid_end)
            if offsets[p + 1] > valid_end:  # prompt padding: keys with no queries
                cu_q.append(q_end)
                cu_k.append(offsets[p + 1])
        cross = VarlenCall(cu_q=cu_q, cu_k=cu_k, causal=False)
    return CascadePlan(segments=segments, cross=cross, prompt_block_end=block_end)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Merge two attention partials over disjoint key sets of the same queries.

    out_* [T, H, D], lse_* [H, T] fp32 -> (out [T, H, D] in out_a's dtype, lse [H, T] fp32)."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).transpose(0, 1).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).transpose(0, 1).unsqueeze(-1)
    acc = torch.promote_types(out_a.dtype, torch.float32)  # bf16 partials are merged in float32
    out = (w_a * out_a.to(acc) + w_b * out_b.to(acc)).to(out_a.dtype)
    return out, lse


def cascade_forward(q, k, v, plan: CascadePlan, scale: float, kernel: VarlenKernel):
    """-> (out, merged lse, aux of each call)."""
    out, lse, aux_seg = kernel.forward(q, k, v, plan.segments, scale)
    aux_cross = None
    if plan.cross is not None:
        e = plan.prompt_block_end
        out_x, lse_x, aux_cross = kernel.forward(q[e:], k[:e], v[:e], plan.cross, scale)
        merged, merged_lse = merge_partials(out[e:], lse[:, e:], out_x, lse_x)
        out[e:] = merged  # the kernel's fresh output buffers: updating them in place saves a copy
        lse[:, e:] = merged_lse
    return out, lse, (aux_seg, aux_cross)


def cascade_backward(dout, q, k, v, out, lse, plan: CascadePlan, scale: float, kernel: VarlenKernel, aux):
    aux_seg, aux_cross = aux
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, plan.segments, scale, aux_seg)
    if plan.cross is not None:
        e = plan.prompt_block_end
        dq_x, dk_x, dv_x = kernel.backward(
            dout[e:], q[e:], k[:e], v[:e], out[e:], lse[:, e:].contiguous(), plan.cross, scale, aux_cross
        )
        dq[e:] += dq_x
        dk[:e] += dk_x
        dv[:e] += dv_x
    return dq, dk, dv


def prefix_shared_attention_cascade(q, k, v, layout: PackedPrefixLayout, softmax_scale: float) -> torch.Tensor:
    check_shapes(q, k, v, layout)
    return PlannedAttention.apply(q, k, v, cascade_plan(layout), float(softmax_scale), kernel_for(q.device))
