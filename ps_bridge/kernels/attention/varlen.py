"""Variable-length flash-attention calls with their log-sum-exp, behind one small interface.

The prefix-shared designs (`cascade.py`, `expand.py`) are written against
`VarlenKernel.forward/backward`: one call attends the queries of batch element b,
`q[cu_q[b]:cu_q[b+1]]`, to the keys `k[cu_k[b]:cu_k[b+1]]`, and returns the output together with its
fp32 log-sum-exp `[Hq, total_q]`. The backward takes the output and log-sum-exp it should use, which
need not be the ones the forward produced: the cascade passes the *merged* ones (see cascade.py).
`PlannedAttention` is the autograd function both designs run their plan's calls through.

Causal masking follows flash-attention's convention (bottom-right aligned): when a batch element has
`Lq` queries and `Lk` keys, query j sees keys `0 .. Lk - Lq + j`. With `Lq == Lk` that is ordinary
causal attention; with a response's queries against `[prompt; response]` keys it is exactly
prefix-shared attention.

Kernels:
- `FlashAttnKernel`: the flash-attn package (`flash_attn_interface._flash_attn_varlen_forward/_backward`).
- `TorchFlashKernel`: torch's own flash kernels (`aten._flash_attention_forward/_backward`), CUDA,
  native grouped-query attention (fewer key/value heads than query heads).
- `CpuFlashKernel`: torch's CPU flash op, one batch element at a time. Slow; it exists so the designs
  built on top (the cascade's LSE merge and its backward, the expand gather) run in CI on a CPU.
- `cudnn.DenseSplitKernel`: on Hopper, a call's long elements on cuDNN's dense attention, the rest on
  one of the above (`cudnn.py`).
`kernel_choice.kernel_for` picks the kernel for a device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Tuple, TypeVar

import torch

from ps_bridge.compat import flash_attn as compat_flash_attn
from ps_bridge.transfer import to_device

T = TypeVar("T")


@dataclass
class VarlenCall:
    """One varlen attention call's batch: cumulative query/key offsets (host lists) and causality.

    Device copies of the offsets are made once per device and reused by every layer.
    """

    cu_q: List[int]
    cu_k: List[int]
    causal: bool
    _device_cu: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _derived: Dict[Hashable, object] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if len(self.cu_q) != len(self.cu_k):
            raise ValueError(f"cu_q has {len(self.cu_q)} entries, cu_k {len(self.cu_k)}: they must match")
        lq = [b - a for a, b in zip(self.cu_q, self.cu_q[1:])]
        lk = [b - a for a, b in zip(self.cu_k, self.cu_k[1:])]
        if any(n < 0 for n in lq + lk):
            raise ValueError("cumulative offsets must be non-decreasing")
        for a, b in zip(lq, lk):
            if a > 0 and b == 0:
                raise ValueError("a batch element with queries has no keys")
            if self.causal and a > b:
                raise ValueError("a causal batch element has more queries than keys (bottom-right mask)")
        self.max_q = max(lq, default=0)
        self.max_k = max(lk, default=0)

    @property
    def total_q(self) -> int:
        return self.cu_q[-1]

    def derived(self, key: Hashable, build: Callable[[], T]) -> T:
        """A value a kernel derives from the offsets alone (`cudnn.split_call`'s pieces), built on first
        use and then shared by every layer, as `PackedPrefixLayout.derived` is. `key` names the value
        and the kernel's parameters."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def device_offsets(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device not in self._device_cu:
            self._device_cu[device] = (
                to_device(torch.tensor(self.cu_q, dtype=torch.int32), device),
                to_device(torch.tensor(self.cu_k, dtype=torch.int32), device),
            )
        return self._device_cu[device]


class VarlenKernel:
    name = "abstract"

    def forward(self, q, k, v, call: VarlenCall, scale: float):
        """-> (out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] fp32, aux passed to backward)."""
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, call: VarlenCall, scale: float, aux):
        """-> (dq, dk, dv) for `out`/`lse` (which may be merged ones, see module docstring)."""
        raise NotImplementedError


def _check_lse(lse: torch.Tensor, heads: int, total_q: int, who: str) -> torch.Tensor:
    if lse.shape != (heads, total_q):
        raise RuntimeError(
            f"{who} returned a log-sum-exp of shape {tuple(lse.shape)}; the prefix-shared cascade needs "
            f"the unpadded varlen form [{heads}, {total_q}] (flash-attention 2.4+ / torch 2.3+)"
        )
    return lse


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the CUDA flash kernels take such inputs: fp16/bf16, head dim a multiple of 8 up to 256."""
    return torch.device(device).type == "cuda" and dtype in FLASH_DTYPES and head_dim <= 256 and head_dim % 8 == 0


def flash_supports(q: torch.Tensor) -> bool:
    """`flash_takes` for the query tensor `q [T, H, D]`."""
    return flash_takes(q.device, q.dtype, q.shape[-1])


def _require_flash_support(q: torch.Tensor, who: str) -> None:
    if not flash_supports(q):
        raise ValueError(
            f"{who}: the CUDA flash kernels take float16/bfloat16 inputs with a head dim that is a multiple "
            f"of 8 up to 256; got {q.dtype}, head dim {q.shape[-1]}. Use the 'auto' backend (it falls back "
            "to torch_ref for such inputs) or 'torch_ref'"
        )


class TorchFlashKernel(VarlenKernel):
    """torch's bundled flash-attention 2 kernels (CUDA, fp16/bf16, head dim <= 256)."""

    name = "torch"

    def forward(self, q, k, v, call, scale):
        _require_flash_support(q, "torch flash attention")
        cu_q, cu_k = call.device_offsets(q.device)
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, call.max_q, call.max_k, 0.0, call.causal, False, scale=scale
        )
        return out, _check_lse(lse, q.shape[1], q.shape[0], "aten._flash_attention_forward"), (rng_state, unused)

    def backward(self, dout, q, k, v, out, lse, call, scale, aux):
        cu_q, cu_k = call.device_offsets(q.device)
        rng_state, unused = aux
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, call.max_q, call.max_k, 0.0, call.causal, rng_state, unused,
            scale=scale,
        )
        return dq, dk, dv


class FlashAttnKernel(VarlenKernel):
    """The flash-attn package's varlen kernels (2.x), with the keywords of the installed release
    (`compat/flash_attn.py`: their lists changed across releases)."""

    name = "flash_attn"

    def __init__(self):
        self._fwd, self._bwd = compat_flash_attn.varlen_functions()

    def forward(self, q, k, v, call, scale):
        _require_flash_support(q, "flash-attn")
        cu_q, cu_k = call.device_offsets(q.device)
        kwargs = compat_flash_attn.varlen_keywords(self._fwd, return_softmax=False)
        res = self._fwd(q, k, v, cu_q, cu_k, call.max_q, call.max_k, 0.0, scale, call.causal, **kwargs)
        out, lse, rng_state = res[0], res[1], res[-1]
        return out, _check_lse(lse, q.shape[1], q.shape[0], "flash_attn._flash_attn_varlen_forward"), rng_state

    def backward(self, dout, q, k, v, out, lse, call, scale, aux):
        cu_q, cu_k = call.device_offsets(q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs = compat_flash_attn.varlen_keywords(self._bwd, rng_state=aux)
        self._bwd(
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, call.max_q, call.max_k, 0.0, scale, call.causal,
            **kwargs,
        )
        return dq, dk, dv


class CpuFlashKernel(VarlenKernel):
    """torch's CPU flash op per batch element; grouped-query heads are repeated and their key/value
    gradients summed back. For tests of the designs built on top, not for speed."""

    name = "cpu"

    @staticmethod
    def _mask(lq: int, lk: int, causal: bool, dtype, device) -> Tuple[bool, Optional[torch.Tensor]]:
        """(is_causal, additive mask): the op's own causal flag is top-left, so a bottom-right causal
        element with Lq != Lk gets an explicit mask."""
        if not causal:
            return False, None
        if lq == lk:
            return True, None
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)
        return False, torch.zeros(lq, lk, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))

    @staticmethod
    def _offsets(call, device):
        """The call's offsets as the CUDA kernels read them, its device tensors (what a bucketed
        layout's replay refills: `PackedPrefixLayout.varying`)."""
        cu_q, cu_k = call.device_offsets(device)
        return cu_q.tolist(), cu_k.tolist()

    @staticmethod
    def _heads(q, k):
        return q.shape[1] // k.shape[1]

    def forward(self, q, k, v, call, scale):
        T, H, D = q.shape
        out = torch.zeros_like(q)
        # float32 like the CUDA kernels; float64 inputs keep float64 so tests can be exact
        lse = torch.zeros(H, T, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        rep = self._heads(q, k)
        cu_q, cu_k = self._offsets(call, q.device)
        for b in range(len(cu_q) - 1):
            qa, qb, ka, kb = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            if qb == qa:
                continue
            is_causal, mask = self._mask(qb - qa, kb - ka, call.causal, q.dtype, q.device)
            qe = q[qa:qb].transpose(0, 1).unsqueeze(0)
            ke = k[ka:kb].repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
            ve = v[ka:kb].repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qe, ke, ve, 0.0, is_causal, attn_mask=mask, scale=scale
            )
            out[qa:qb] = o[0].transpose(0, 1)
            lse[:, qa:qb] = l[0]
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, call, scale, aux):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rep = self._heads(q, k)
        Hkv = k.shape[1]
        cu_q, cu_k = self._offsets(call, q.device)
        for b in range(len(cu_q) - 1):
            qa, qb, ka, kb = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            if qb == qa:
                continue
            is_causal, mask = self._mask(qb - qa, kb - ka, call.causal, q.dtype, q.device)

            def bh(x):
                return x.transpose(0, 1).unsqueeze(0).contiguous()

            g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                bh(dout[qa:qb]),
                bh(q[qa:qb]),
                bh(k[ka:kb].repeat_interleave(rep, dim=1)),
                bh(v[ka:kb].repeat_interleave(rep, dim=1)),
                bh(out[qa:qb]),
                lse[:, qa:qb].unsqueeze(0).contiguous(),
                0.0,
                is_causal,
                attn_mask=mask,
                scale=scale,
            )
            dq[qa:qb] += g_q[0].transpose(0, 1)
            lk = kb - ka
            dk[ka:kb] += g_k[0].transpose(0, 1).reshape(lk, Hkv, rep, -1).sum(2)
            dv[ka:kb] += g_v[0].transpose(0, 1).reshape(lk, Hkv, rep, -1).sum(2)
        return dq, dk, dv


# ---- what the designs on top share ------------------------------------------------------------


def check_shapes(q, k, v, layout) -> None:
    """Packed `q [T, Hq, D]`, `k, v [T, Hkv, D]` over `layout`'s T tokens, Hq a multiple of Hkv."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"expected q [T, Hq, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != layout.num_tokens or k.shape[0] != layout.num_tokens:
        raise ValueError(f"q/k have {q.shape[0]}/{k.shape[0]} tokens, the layout {layout.num_tokens}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


class PlannedAttention(torch.autograd.Function):
    """Runs a plan's varlen calls forward (`plan.forward`), and their backwards (`plan.backward`)
    from the saved output and log-sum-exp (for the cascade: the merged ones)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale, kernel):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse, aux = plan.forward(q, k, v, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.kernel, ctx.aux = plan, scale, kernel, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.plan.backward(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.kernel, ctx.aux)
        return dq, dk, dv, None, None, None
