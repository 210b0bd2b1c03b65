"""cuDNN's dense attention for the long batch elements of a varlen call, the flash varlen kernel for the
rest (`DenseSplitKernel`, a `VarlenKernel`: the cascade and the unshared path run on it unchanged).

On an H200 (cuDNN 9.19, torch 2.11, bf16, 32 query / 8 key-value heads of 128) cuDNN's fused attention
(`aten._scaled_dot_product_cudnn_attention[_backward]`) takes 0.54-0.61x the time of torch's bundled
flash-attention 2 on long sequences, forward and backward: a causal 4096-token sequence 0.29 / 0.82 ms
against 0.53 / 1.42 ms, 4096 queries against 4096 keys 0.45 / 1.28 ms against 0.80 / 2.36 ms
(`tools/probe_attention_kernels.py`). Its ragged (varlen) form is not usable in that release (wrong
gradients, top-left causal mask), so each long element runs as its own dense batch of one.

cuDNN builds an execution plan per shape, 65 ms forward and 78 ms backward on that machine
(`tools/probe_cudnn_plan_cost.py`), and caches it. So that plans recur across micro-batches whose lengths
vary, a dense call's lengths are multiples of `QUANTUM`:
- a causal element (`Lq == Lk`) is padded at its end to the next multiple: the valid queries never see
  the padding keys (the mask is causal), the padding queries' rows are dropped, and in the backward
  they get a zero output gradient and a log-sum-exp that makes their probabilities zero, so they add
  nothing to any key's gradient;
- a non-causal element's queries are padded likewise; its keys are cut at the last multiple, and the
  remaining keys (fewer than `QUANTUM`) are one more flash partial of the same queries, merged by
  log-sum-exp (`merge.py`) as the cascade merges its levels; the backward runs each partial with the
  merged output and log-sum-exp, exactly as the cascade does (see cascade.py).
An element is dense when it has at least `MIN_WORK` query-key pairs (a causal one: `Lq == Lk`, whole
keys; a non-causal one: at least `QUANTUM` keys); consecutive other elements form one flash varlen call
over their contiguous slice. Causal elements with `Lq != Lk` (bottom-right mask, the expand design)
always run on flash.

Used on CUDA devices of compute capability 9 (where it was measured) while torch's cuDNN attention is
enabled (`torch.backends.cuda.enable_cudnn_sdp(False)` turns it off), for fp16/bf16 inputs with a head
dim up to 128 (larger ones, Qwen3.5's 256, run on flash); never on a bucketed layout, whose key offsets
a CUDA graph's replay refills on the device (`cascade.py`). `dense` is pluggable so that the split, the
padding and the merges run in CI on a CPU against the plain kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ps_bridge.compat.torch import has_cudnn_attention
from ps_bridge.kernels.attention.merge import merge_into
from ps_bridge.kernels.attention.varlen import FLASH_DTYPES, VarlenCall, VarlenKernel

QUANTUM = 256  # dense calls' lengths are multiples of this (plans recur; at most QUANTUM - 1 padding rows)
MIN_WORK = 2048 * 2048  # query-key pairs of the smallest dense element
MAX_HEAD_DIM = 128
# the padding queries' log-sum-exp in the backward: exp(score - PAD_LSE) is 0 for any finite score
PAD_LSE = 1.0e4


@dataclass
class DensePiece:
    """Element queries [qa, qa + lq) against keys [ka, ka + lk); `lq_pad`/`lk_dense` the dense call's
    lengths; `tail`, a non-causal element's keys past `lk_dense`, as a one-element flash call."""

    qa: int
    ka: int
    lq: int
    lk: int
    causal: bool
    lq_pad: int
    lk_dense: int
    tail: Optional[VarlenCall]

    @property
    def keys_end(self) -> int:
        """End of the element's keys that the dense call reads (a causal element's padding is not keys)."""
        return self.ka + min(self.lk, self.lk_dense)


@dataclass
class VarlenPiece:
    """A run of consecutive elements: queries [qa, qb), keys [ka, kb), offsets rebased."""

    qa: int
    qb: int
    ka: int
    kb: int
    call: VarlenCall


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def split_call(call: VarlenCall, quantum: int = QUANTUM, min_work: int = MIN_WORK) -> List[object]:
    """The call's elements as dense pieces and varlen runs, in order (host integers only)."""
    pieces: List[object] = []
    run: List[int] = []  # element indices of the current varlen run

    def close_run():
        if not run:
            return
        a, b = run[0], run[-1] + 1
        qa, ka = call.cu_q[a], call.cu_k[a]
        if call.cu_q[b] > qa:  # a run of keys-only elements computes nothing
            pieces.append(VarlenPiece(qa, call.cu_q[b], ka, call.cu_k[b], VarlenCall(
                cu_q=[x - qa for x in call.cu_q[a:b + 1]], cu_k=[x - ka for x in call.cu_k[a:b + 1]],
                causal=call.causal)))
        run.clear()

    for e in range(len(call.cu_q) - 1):
        qa, ka = call.cu_q[e], call.cu_k[e]
        lq, lk = call.cu_q[e + 1] - qa, call.cu_k[e + 1] - ka
        dense = lq * lk >= min_work and (lq == lk if call.causal else lk >= quantum)
        if not dense:
            run.append(e)
            continue
        close_run()
        lk_dense = lk if call.causal else lk // quantum * quantum
        tail = None if lk_dense == lk else VarlenCall(cu_q=[0, lq], cu_k=[0, lk - lk_dense], causal=False)
        pieces.append(DensePiece(qa, ka, lq, lk, call.causal, _round_up(lq, quantum),
                                 _round_up(lk, quantum) if call.causal else lk_dense, tail))
    close_run()
    return pieces


def _padded(x: torch.Tensor, rows: int, fill: float = 0.0) -> torch.Tensor:
    """`x [L, ...]` with `rows - L` rows of `fill` after it (`x` itself when no row is missing)."""
    if x.shape[0] == rows:
        return x
    out = x.new_full((rows, *x.shape[1:]), fill)
    out[: x.shape[0]] = x
    return out


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """packed [L, H, D] -> a [1, H, L, D] view (the layout cuDNN's attention reads)."""
    return x.unsqueeze(0).transpose(1, 2)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """[1, H, L, D] -> [L, H, D]."""
    return x[0].transpose(0, 1)


class CudnnDense:
    """One dense batch-of-one attention call and its backward on cuDNN (`aten._scaled_dot_product_cudnn_
    attention[_backward]`): `[1, H, L, D]` inputs, log-sum-exp `[1, H, Lq, 1]` float32, top-left causal."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return r[0], r[1], tuple(r[2:8])

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float, aux):
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)


class DenseSplitKernel(VarlenKernel):
    """A call's long elements on `dense` (cuDNN), the rest on `varlen` (flash); see the module docstring."""

    name = "cudnn+flash"

    def __init__(self, varlen: VarlenKernel, dense=CudnnDense, quantum: int = QUANTUM, min_work: int = MIN_WORK,
                 takes: Optional[Callable[[torch.Tensor], bool]] = None):
        self.varlen, self.dense, self.quantum, self.min_work = varlen, dense, quantum, min_work
        self.name = f"cudnn+{varlen.name}"
        self._takes = takes or dense_takes

    def _pieces(self, call: VarlenCall, q: torch.Tensor):
        if not self._takes(q):
            return None
        pieces = call.derived(("dense_split", self.quantum, self.min_work),
                              lambda: split_call(call, self.quantum, self.min_work))
        return None if all(isinstance(p, VarlenPiece) for p in pieces) else pieces

    def forward(self, q, k, v, call, scale):
        pieces = self._pieces(call, q)
        if pieces is None:
            return self.varlen.forward(q, k, v, call, scale)
        out = torch.empty_like(q)
        # float32 as the kernels return it (float64 inputs keep float64, for exact tests)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        aux = []
        for p in pieces:
            if isinstance(p, VarlenPiece):
                o, l, a = self.varlen.forward(q[p.qa:p.qb], k[p.ka:p.kb], v[p.ka:p.kb], p.call, scale)
                out[p.qa:p.qb], lse[:, p.qa:p.qb] = o, l
                aux.append(a)
                continue
            qd = _bhsd(_padded(q[p.qa:p.qa + p.lq], p.lq_pad))
            kd = _bhsd(_padded(k[p.ka:p.keys_end], p.lk_dense))
            vd = _bhsd(_padded(v[p.ka:p.keys_end], p.lk_dense))
            o, l, a = self.dense.forward(qd, kd, vd, p.causal, scale)
            out[p.qa:p.qa + p.lq] = _packed(o)[: p.lq]
            lse[:, p.qa:p.qa + p.lq] = l[0, :, : p.lq, 0]
            tail_aux = None
            if p.tail is not None:
                ks = p.ka + p.lk_dense
                o_t, l_t, tail_aux = self.varlen.forward(q[p.qa:p.qa + p.lq], k[ks:p.ka + p.lk], v[ks:p.ka + p.lk],
                                                         p.tail, scale)
                merge_into(out[p.qa:p.qa + p.lq], lse[:, p.qa:p.qa + p.lq], [o_t], [l_t])
            aux.append((a, tail_aux))
        return out, lse, (pieces, aux)

    def backward(self, dout, q, k, v, out, lse, call, scale, aux):
        if self._pieces(call, q) is None:
            return self.varlen.backward(dout, q, k, v, out, lse, call, scale, aux)
        pieces, auxes = aux
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for p, a in zip(pieces, auxes):
            if isinstance(p, VarlenPiece):
                g = self.varlen.backward(dout[p.qa:p.qb], q[p.qa:p.qb], k[p.ka:p.kb], v[p.ka:p.kb], out[p.qa:p.qb],
                                         lse[:, p.qa:p.qb].contiguous(), p.call, scale, a)
                dq[p.qa:p.qb] += g[0]
                dk[p.ka:p.kb] += g[1]
                dv[p.ka:p.kb] += g[2]
                continue
            dense_aux, tail_aux = a
            rows = slice(p.qa, p.qa + p.lq)
            keys = p.keys_end
            lse_rows = _padded(lse[:, rows].t(), p.lq_pad, PAD_LSE).t()  # [H, lq_pad]
            g = self.dense.backward(
                _bhsd(_padded(dout[rows], p.lq_pad)), _bhsd(_padded(q[rows], p.lq_pad)),
                _bhsd(_padded(k[p.ka:keys], p.lk_dense)), _bhsd(_padded(v[p.ka:keys], p.lk_dense)),
                _bhsd(_padded(out[rows], p.lq_pad)), lse_rows.unsqueeze(0).unsqueeze(-1).contiguous(),
                p.causal, scale, dense_aux)
            n = keys - p.ka
            dq[rows] += _packed(g[0])[: p.lq]
            dk[p.ka:keys] += _packed(g[1])[:n]
            dv[p.ka:keys] += _packed(g[2])[:n]
            if p.tail is not None:
                ks, ke = p.ka + p.lk_dense, p.ka + p.lk
                g = self.varlen.backward(dout[rows], q[rows], k[ks:ke], v[ks:ke], out[rows],
                                         lse[:, rows].contiguous(), p.tail, scale, tail_aux)
                dq[rows] += g[0]
                dk[ks:ke] += g[1]
                dv[ks:ke] += g[2]
        return dq, dk, dv


def dense_takes(q: torch.Tensor) -> bool:
    """Whether cuDNN's attention takes `q [T, H, D]`: fp16/bf16, head dim a multiple of 8 up to 128."""
    return q.dtype in FLASH_DTYPES and q.shape[-1] <= MAX_HEAD_DIM and q.shape[-1] % 8 == 0


def cudnn_dense_available(device: torch.device) -> Tuple[bool, str]:
    """(whether the split kernel is used on `device`, why not). torch's switch is read at every call (it
    may change at run time), the rest once per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, "not a CUDA device"
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False, "torch's cuDNN attention is off (torch.backends.cuda.enable_cudnn_sdp)"
    return _device_takes_cudnn(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_takes_cudnn(index: int) -> Tuple[bool, str]:
    if not has_cudnn_attention():
        return False, "this torch has no cuDNN attention op"
    if not torch.backends.cudnn.is_available():
        return False, "cuDNN is not available"
    version = torch.backends.cudnn.version() or 0
    if version < 90000:
        return False, f"cuDNN {version} (9.0 or later is used)"
    major = torch.cuda.get_device_capability(index)[0]
    if major != 9:
        return False, f"compute capability {major}.x (used on 9.x, where it was measured)"
    return True, ""
