"""`flash_atten_gpu`: prefix-shared attention on a prefix tree as a cascade of varlen flash calls,
copying no key/value.

It runs on the packed layout of ps_bridge.layout: one segment per tree node, packed level by level
(all roots, then their children, ...), depth first inside a level, each segment padded at its end.
Two facts of that order make every call a plain varlen call over contiguous views of q, k and v:
each level is one contiguous *block* of the pack, and inside a level the descendants of any node
form one contiguous *run*. A token attends causally inside its own node and to every valid token of
its ancestors; the ancestors of a level-d node are one node per level a < d. So:

  1. one causal call over every segment of the pack, with the padded segment offsets: each token
     sees its own node causally (padding sits at segment ends, so no valid query ever sees it);
  2. for each distance k = 1 .. D, one non-causal call of the queries of levels k .. D (one
     contiguous range of the pack) against their ancestors k levels up (the keys of levels 0 .. D - k,
     one contiguous range too): for each level d >= k in turn, batch element A pairs the run of
     A's level-d descendants (queries) with A's valid keys, for every level-(d - k) node A in pack
     order (both sequences of offsets are non-decreasing because every level goes depth first, and
     level d's elements follow level d - 1's on both sides). A node's padding, and a node without
     descendants k levels down, are batch elements with keys and no queries, so neither a copy nor
     a `seqused_k` (which torch's backward lacks) is needed. A flash kernel computes each batch
     element on its own, so an element's result does not depend on which call holds it;
  3. each level's partial results (its own causal call and one per ancestor level, from the calls of
     distances 1 .. d) are merged by their log-sum-exp, in float32, once per level, into the first
     call's output (`merge.py`).
  A bucketed layout (`PackedPrefixLayout.bucketed`) keeps its padding element even where it holds no
  key, and states the ancestor block's length as the calls' longest key run: the calls' batch sizes
  and maximum lengths then follow the tree and the buckets only, and the key offsets, which follow
  the nodes' valid lengths, are `varying` values (a CUDA graph's replay refills them). Under level
  buckets (`PackedPrefixLayout.level_buckets`: segments at their own lengths, each level's block
  padded to a bucket on its last segment) the segments' offsets, and with them every call's query
  offsets, follow the lengths too: they are `varying` values as well, and each call is told a bound
  on its longest element, which the kernels read only to size their grids: the causal call takes each
  level's padding as a few elements of their own and is bounded by the power of two above its longest
  element (`host["segment_bound"]`, part of the structure), an ancestor call by its largest query and
  key level blocks.
  Kernel launches per layer: 1 + D for a tree of depth D, whatever its node count; no key/value (or
  query) is copied: every call reads views of the packed tensors.
  Backward: each call's flash backward is run with the *merged* output and log-sum-exp of its
  queries and the gradients are summed. That is exact: a flash backward rebuilds the probabilities
  as exp(scores - lse) and the row term from (dout * out), so with the merged values each call
  yields its share of the true gradient, and no gradient through the log-sum-exp is needed.

Kernels come from ps_bridge.kernels.attention.varlen: flash-attn if installed, else torch's own
CUDA flash kernels; on a CPU torch's CPU flash op (slow, used by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from ps_bridge.kernels.attention.merge import merge_into
from ps_bridge.kernels.attention.kernel_choice import kernel_for
from ps_bridge.kernels.attention.varlen import PlannedAttention, VarlenCall, VarlenKernel, check_shapes
from ps_bridge.layout import PackedPrefixLayout
from ps_bridge.tree.level_buckets import padding_pieces


@dataclass
class AncestorCall:
    """Queries of a range of levels against the keys of the levels a fixed distance above them."""

    call: VarlenCall  # non-causal; offsets relative to the two ranges
    queries: Tuple[int, int]  # packed range [start, end) of the query levels' blocks
    keys: Tuple[int, int]  # packed range [start, end) of the ancestor levels' blocks


@dataclass
class CascadePlan:
    segments: VarlenCall  # causal, every segment of the pack
    ancestors: List[AncestorCall]  # distances 1 .. depth (empty when nothing is shared)
    levels: List[Tuple[int, int]]  # packed range [start, end) of each level 1 .. depth's block

    @property
    def num_calls(self) -> int:
        """Varlen kernel launches per layer (forward; the backward runs as many)."""
        return 1 + len(self.ancestors)

    def partials(self, d: int, outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]):
        """Level d's rows of the ancestor calls' partials `outs` / `lses` (one per distance), the farthest
        ancestor level's (the roots') first."""
        qs, qe = self.levels[d - 1]
        rows = [slice(qs - x.queries[0], qe - x.queries[0]) for x in self.ancestors[:d]][::-1]
        return [o[r] for o, r in zip(outs[:d][::-1], rows)], [l[:, r] for l, r in zip(lses[:d][::-1], rows)]

    def forward(self, q, k, v, scale, kernel):
        return cascade_forward(q, k, v, self, scale, kernel)

    def backward(self, dout, q, k, v, out, lse, scale, kernel, aux):
        return cascade_backward(dout, q, k, v, out, lse, self, scale, kernel, aux)


def cascade_plan(layout: PackedPrefixLayout) -> CascadePlan:
    # derived from host metadata only: built once per layout, for every layer
    return layout.derived("flash_cascade_plan", lambda: _build_cascade_plan(layout))


def _bind_varying_offsets(layout: PackedPrefixLayout, plan: CascadePlan, device) -> None:
    """A bucketed layout's ancestor calls' key offsets on `device`, registered as `varying` values;
    under level buckets every call's query and key offsets."""

    def register(name, call, side, pick):
        static = call.device_offsets(device)[side]
        field = ("cu_q", "cu_k")[side]
        layout.varying((name, side, str(device)), static, lambda other: torch.tensor(
            getattr(pick(cascade_plan(other)), field), dtype=static.dtype))

    def bind():
        sides = (0, 1) if layout.level_buckets else (1,)
        for side in sides:
            if layout.level_buckets:
                register("cascade_segments", plan.segments, side, lambda p: p.segments)
            for k, x in enumerate(plan.ancestors):
                register(("cascade", k), x.call, side, lambda p, k=k: p.ancestors[k].call)
        return True

    layout.derived(("cascade_varying", str(device)), bind)


def _build_cascade_plan(layout: PackedPrefixLayout) -> CascadePlan:
    host = layout.host
    offsets = host["cu_seqlens_padded"]
    level_offsets = host["level_offsets"]
    if layout.level_buckets:
        cu = _level_segment_offsets(layout)
        segments = VarlenCall(cu_q=cu, cu_k=list(cu), causal=True)
        if segments.max_q > host["segment_bound"]:  # the grid would miss its end
            raise AssertionError(f"level buckets: an element of {segments.max_q} tokens in a causal call "
                                 f"bounded at {host['segment_bound']}")
        segments.max_q = segments.max_k = host["segment_bound"]
    else:
        segments = VarlenCall(cu_q=list(offsets), cu_k=list(offsets), causal=True)
    parent = host["segment_parent"]
    valid = host["valid_lengths"]
    depth = len(level_offsets) - 2
    by_distance: List[List[AncestorCall]] = [[] for _ in range(depth)]
    for d in range(1, depth + 1):
        lo, hi = level_offsets[d], level_offsets[d + 1]
        ancestor = list(range(lo, hi))  # each level-d segment's ancestor at level a, walking up
        for a in range(d - 1, -1, -1):
            ancestor = [parent[s] for s in ancestor]
            x = _ancestor_call(ancestor, offsets, valid, level_offsets[a], level_offsets[a + 1], lo, hi, layout.bucketed)
            if layout.level_buckets:
                x.call.max_q = offsets[hi] - offsets[lo]
            by_distance[d - a - 1].append(x)
    levels = [(offsets[level_offsets[d]], offsets[level_offsets[d + 1]]) for d in range(1, depth + 1)]
    return CascadePlan(segments=segments, ancestors=[_joined(calls) for calls in by_distance], levels=levels)


def _joined(calls: Sequence[AncestorCall]) -> AncestorCall:
    """One call of the batch elements of `calls`, in order: each call's queries and keys follow the
    previous one's in the pack (the levels of one distance, shallowest first). Its longest query and
    key runs are the calls' (a bucketed call states its blocks')."""
    for x, y in zip(calls, calls[1:]):
        if x.queries[1] != y.queries[0] or x.keys[1] != y.keys[0]:
            raise AssertionError(f"the calls of one distance are not adjacent in the pack: {x.queries, x.keys} "
                                 f"then {y.queries, y.keys}")
    cu_q, cu_k = [0], [0]
    for x in calls:
        q0, k0 = x.queries[0] - calls[0].queries[0], x.keys[0] - calls[0].keys[0]
        cu_q += [q0 + c for c in x.call.cu_q[1:]]
        cu_k += [k0 + c for c in x.call.cu_k[1:]]
    call = VarlenCall(cu_q=cu_q, cu_k=cu_k, causal=False)
    call.max_q = max(x.call.max_q for x in calls)
    call.max_k = max(x.call.max_k for x in calls)
    return AncestorCall(call=call, queries=(calls[0].queries[0], calls[-1].queries[1]),
                        keys=(calls[0].keys[0], calls[-1].keys[1]))


def _level_segment_offsets(layout: PackedPrefixLayout) -> List[int]:
    """The causal call's offsets under level buckets: every segment at its own length, and each level's
    padding (on its last segment) as `PADDING_PIECES` elements of its own (padding attends only to
    padding), so that no element is much longer than the longest segment."""
    host = layout.host
    offsets, level_offsets = host["cu_seqlens_padded"], host["level_offsets"]
    cu = [0]
    for lo, hi in zip(level_offsets, level_offsets[1:]):
        cu += offsets[lo + 1:hi]
        own_end = offsets[hi - 1] + host["own_lengths"][hi - 1]
        cu += [own_end] + padding_pieces(own_end, offsets[hi])
    return cu


def _ancestor_call(ancestor: Sequence[int], offsets: Sequence[int], valid: Sequence[int], a_lo: int, a_hi: int,
                   d_lo: int, d_hi: int, bucketed: bool = False) -> AncestorCall:
    """The call of level d's queries (segments `d_lo .. d_hi`, whose level-a ancestors are `ancestor`)
    against level a's keys (segments `a_lo .. a_hi`): one batch element per level-a node (and its
    padding; `bucketed`: see the module docstring)."""
    if any(x > y for x, y in zip(ancestor, ancestor[1:])):
        raise AssertionError("a level's descendants of one node are not one run: the pack is not depth first inside a level")
    q_base, k_base = offsets[d_lo], offsets[a_lo]
    run_end: dict = {}  # level-a node -> end of its descendants' run in level d
    for i, A in enumerate(ancestor):
        run_end[A] = offsets[d_lo + i + 1] - q_base
    cu_q: List[int] = [0]
    cu_k: List[int] = [0]

    def add(q_end: int, k_end: int) -> None:
        if q_end == cu_q[-1] and len(cu_q) > 1 and cu_q[-2] == cu_q[-1]:
            cu_k[-1] = k_end  # consecutive keys-only elements are one
        else:
            cu_q.append(q_end)
            cu_k.append(k_end)

    for A in range(a_lo, a_hi):
        q_end = run_end.get(A, cu_q[-1])
        valid_end = offsets[A] + valid[A] - k_base
        add(q_end, valid_end)
        if bucketed or offsets[A + 1] - k_base > valid_end:  # padding: keys with no queries
            add(q_end, offsets[A + 1] - k_base)
    call = VarlenCall(cu_q=cu_q, cu_k=cu_k, causal=False)
    if bucketed:
        call.max_k = offsets[a_hi] - k_base
    if call.total_q != offsets[d_hi] - q_base:
        raise AssertionError("an ancestor call's queries do not cover its level's block")
    return AncestorCall(call=call, queries=(q_base, offsets[d_hi]), keys=(k_base, offsets[a_hi]))


def cascade_forward(q, k, v, plan: CascadePlan, scale: float, kernel: VarlenKernel):
    """-> (out, merged lse, aux of each call)."""
    out, lse, aux_seg = kernel.forward(q, k, v, plan.segments, scale)
    outs, lses, auxes = [], [], []
    for x in plan.ancestors:
        (qs, qe), (ks, ke) = x.queries, x.keys
        o, l, aux = kernel.forward(q[qs:qe], k[ks:ke], v[ks:ke], x.call, scale)
        outs.append(o), lses.append(l), auxes.append(aux)
    for d, (qs, qe) in enumerate(plan.levels, start=1):
        # into the segments call's fresh output buffers, in place
        merge_into(out[qs:qe], lse[:, qs:qe], *plan.partials(d, outs, lses))
    return out, lse, (aux_seg, auxes)


def cascade_backward(dout, q, k, v, out, lse, plan: CascadePlan, scale: float, kernel: VarlenKernel, aux):
    aux_seg, auxes = aux
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, plan.segments, scale, aux_seg)
    for x, aux_x in zip(plan.ancestors, auxes):
        (qs, qe), (ks, ke) = x.queries, x.keys
        dq_x, dk_x, dv_x = kernel.backward(
            dout[qs:qe], q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], lse[:, qs:qe].contiguous(), x.call, scale, aux_x
        )
        dq[qs:qe] += dq_x
        dk[ks:ke] += dk_x
        dv[ks:ke] += dv_x
    return dq, dk, dv


def prefix_shared_attention_cascade(q, k, v, layout: PackedPrefixLayout, softmax_scale: float) -> torch.Tensor:
    check_shapes(q, k, v, layout)
    plan = cascade_plan(layout)
    if layout.bucketed:
        _bind_varying_offsets(layout, plan, q.device)
    # a bucketed layout's key offsets are refilled on the device at a graph's replay: flash reads them there
    return PlannedAttention.apply(q, k, v, plan, float(softmax_scale), kernel_for(q.device, dense=not layout.bucketed))

