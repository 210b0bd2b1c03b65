"""`PackedSeqParams` that also carries the prefix-shared layout.

megatron-core passes `packed_seq_params` untouched from `GPTModel.forward` to every layer, so a
subclass with one extra field is how the layout reaches our attention (and GDN) modules without
any global state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.packed_seq_params import PackedSeqParams

from ps_bridge.layout import PackedPrefixLayout


@dataclass
class PrefixSharedPackedSeqParams(PackedSeqParams):
    prefix_layout: Optional[PackedPrefixLayout] = None
    prefix_sharing_backend: str = "torch_ref"

    @classmethod
    def from_layout(cls, layout: PackedPrefixLayout, backend: str = "torch_ref") -> "PrefixSharedPackedSeqParams":
        # megatron-core reads cu_seqlens only to apply RoPE (our attention and GDN read the layout).
        # Its THD RoPE loops over the packed sequences with a host sync per sequence; since our
        # RoPE table is already per token (PrefixSharedGPTModel), we present the whole pack as a
        # single THD sequence so RoPE is one vectorised op. The real segment boundaries live in
        # `prefix_layout.cu_seqlens` / `cu_seqlens_padded`.
        T = layout.num_tokens
        whole = layout.cu_seqlens_padded.new_tensor([0, T])
        return cls(
            qkv_format="thd",
            cu_seqlens_q=whole,
            cu_seqlens_kv=whole,
            cu_seqlens_q_padded=whole,
            cu_seqlens_kv_padded=whole,
            max_seqlen_q=T,
            max_seqlen_kv=T,
            prefix_layout=layout,
            prefix_sharing_backend=backend,
        )


def require_prefix_layout(packed_seq_params, where: str) -> PackedPrefixLayout:
    layout = getattr(packed_seq_params, "prefix_layout", None)
    if layout is None:
        raise ValueError(
            f"{where} is prefix-aware and needs the packed prefix layout: call the model with "
            "packed_seq_params=PrefixSharedPackedSeqParams.from_layout(layout) "
            "(ps_bridge.models.packed_seq), not with plain padded or THD input"
        )
    return layout
