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
        host = layout.host
        return cls(
            qkv_format="thd",
            cu_seqlens_q=layout.cu_seqlens,
            cu_seqlens_kv=layout.cu_seqlens,
            cu_seqlens_q_padded=layout.cu_seqlens_padded,
            cu_seqlens_kv_padded=layout.cu_seqlens_padded,
            max_seqlen_q=host["max_padded_length"],
            max_seqlen_kv=host["max_padded_length"],
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
