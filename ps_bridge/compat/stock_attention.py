"""Causal softmax core attention for the *stock* Megatron model where Transformer Engine is absent.

Megatron-Bridge's stock provider builds its layers with Transformer Engine's core attention; without
TE, megatron-core's local `DotProductAttention` (megatron/core/transformer/dot_product_attention.py)
refuses verl's packed THD input (`packed_seq_params`) and its padded BSHD mask. The stock engine that
verl-check, the tests and verl's `main_ppo` on a CPU compare ours against therefore takes this core
attention: plain float32 softmax, or on a GPU in bf16/fp16 the flash varlen kernels our unshared path
runs. It stands in for the stock model's attention and is never part of ours.
"""

from __future__ import annotations

import math

import torch

from ps_bridge.kernels.attention.kernel_choice import kernel_for
from ps_bridge.kernels.attention.varlen import PlannedAttention, VarlenCall, flash_supports, flash_takes

def _causal_attention(q, k, v, key_valid, scale):
    """q [H, S, D], k/v [Hkv, S, D], key_valid [S] -> [H, S, D] (float32 math)."""
    rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, dim=0)
    v = v.repeat_interleave(rep, dim=0)
    S = q.shape[1]
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril() & key_valid[None, :]
    mask |= torch.eye(S, dtype=torch.bool, device=q.device)  # padding queries stay finite
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def stock_uses_flash(query: torch.Tensor) -> bool:
    """The stock THD model attends with the flash varlen kernels our unshared path runs (CUDA,
    fp16/bf16, head dim the kernels take); elsewhere with the plain reference."""
    return query.dim() == 3 and flash_supports(query)


def stock_attention_name(dtype: torch.dtype) -> str:
    """What `ReferenceCoreAttention` runs for THD inputs of `dtype` on this machine (for the output)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if flash_takes(device, dtype, 128):
        return f"flash varlen ({kernel_for(device).name}), as the unshared path"
    return "plain softmax reference (ReferenceCoreAttention)"


class _CausalPlan:
    """One causal varlen call over verl's padded THD segments (the plan interface PlannedAttention runs)."""

    def __init__(self, bounds):
        self.call = VarlenCall(cu_q=list(bounds), cu_k=list(bounds), causal=True)

    def forward(self, q, k, v, scale, kernel):
        return kernel.forward(q, k, v, self.call, scale)

    def backward(self, dout, q, k, v, out, lse, scale, kernel, aux):
        return kernel.backward(dout, q, k, v, out, lse, self.call, scale, aux)


def _flash_causal(q, k, v, bounds, scale):
    return PlannedAttention.apply(q, k, v, _CausalPlan(bounds), float(scale), kernel_for(q.device))


def _reference_core_attention_class():
    # imported here: megatron-core is heavy
    from megatron.core.transformer.module import MegatronModule

    class ReferenceCoreAttention(MegatronModule):
        """Causal softmax attention for verl's stock formats: THD with `cu_seqlens_*_padded`, or
        BSHD `[s, b, h, d]` with verl's `[b, s]` validity mask. The test's ground truth; on a GPU in
        bf16/fp16 the THD path runs the flash varlen kernels of our unshared path instead."""

        def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
            super().__init__(config=config)
            self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            if packed_seq_params is not None:
                bounds = packed_seq_params.cu_seqlens_q_padded.tolist()
                if stock_uses_flash(query):
                    return _flash_causal(query, key, value, bounds, self.scale).reshape(query.shape[0], -1)
                out = torch.empty_like(query)
                for a, b in zip(bounds[:-1], bounds[1:]):
                    valid = torch.ones(b - a, dtype=torch.bool, device=query.device)
                    seg = _causal_attention(query[a:b].transpose(0, 1), key[a:b].transpose(0, 1),
                                            value[a:b].transpose(0, 1), valid, self.scale)
                    out[a:b] = seg.transpose(0, 1)
                return out.reshape(out.shape[0], -1)
            S, B = query.shape[:2]
            out = torch.empty_like(query)
            for i in range(B):
                valid = attention_mask[i].bool().reshape(-1)[-S:] if attention_mask is not None else torch.ones(S, dtype=torch.bool)
                seg = _causal_attention(query[:, i].transpose(0, 1), key[:, i].transpose(0, 1),
                                        value[:, i].transpose(0, 1), valid, self.scale)
                out[:, i] = seg.transpose(0, 1)
            return out.reshape(S, B, -1)

    return ReferenceCoreAttention


def reference_gpt_layer_spec(config, vp_stage=None):
    """Our block spec (this stage's layers) with the reference core attention: the stock engine's
    stock-format model."""
    # imported here: megatron-core is heavy
    from ps_bridge.models.specs import prefix_shared_gpt_layer_spec

    spec = prefix_shared_gpt_layer_spec(config, vp_stage=vp_stage)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = _reference_core_attention_class()
    return spec


