"""`PackedSeqParams` that carries everything a prefix-aware module needs from the micro-batch.

megatron-core passes `packed_seq_params` untouched from `GPTModel.forward` to every layer, so a
subclass with a few extra fields is how the micro-batch reaches our modules without any global
state: the packed layout (attention pattern, positions, GDN segments), the softmax-attention backend
by name, the MoE routers' token weights (derived from the layout on first use) and the positions at
which the output layer runs (`output_positions`, from the layout: `PrefixSharedGPTModel`). What is fixed
when the model is built (the Gated DeltaNet backend) lives on the model's config instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ps_bridge.layout import PackedPrefixLayout


def moe_token_weights(layout: PackedPrefixLayout) -> torch.Tensor:
    """`[T]` float32 on the layout's device: the number of samples whose sequence passes through
    each packed position (a shared prompt token: its group's size; in a tree, the samples below its
    node that reach it; 1 when unshared; 0 for padding): how often each row reads it (cached)."""

    def build():
        source = layout.row_source.to(layout.device)
        return torch.bincount(source, minlength=layout.num_tokens).to(torch.float32)

    return layout.derived(("moe_token_weights", str(layout.device)), build)


@dataclass
class PrefixSharedPackedSeqParams(PackedSeqParams):
    prefix_layout: Optional[PackedPrefixLayout] = None
    attention_backend: str = "torch_ref"
    # context parallelism: this rank runs positions `cp_shard` of the layout's pack (all when None)
    cp_shard: Optional[slice] = None
    # the positions of this rank's tokens whose output-layer values the rows read, sorted (the
    # layout's `local_output_positions`); None: the output layer runs on every position
    output_positions: Optional[torch.Tensor] = None
    # of those, the ones the output layer runs on (a bucketed layout's `output_keep`); None: all
    output_keep: Optional[torch.Tensor] = None
    # the model stops before its output layer and returns the final hidden states at the output
    # positions (`SelectedOutputsMixin`): CUDA graphs capture the pass up to there, and the output
    # layer runs eagerly (`cuda_graphs.graphed`)
    hidden_states_only: bool = False

    @property
    def moe_token_weights(self) -> torch.Tensor:
        """Per-token weights of the MoE load-balancing statistics (see `models/moe.py`), for the
        tokens this rank runs (its CP shard)."""
        weights = moe_token_weights(self.prefix_layout)
        return weights if self.cp_shard is None else weights[self.cp_shard]

    @property
    def local_positions(self) -> torch.Tensor:
        """The RoPE positions of the tokens this rank runs (its CP shard)."""
        positions = self.prefix_layout.positions
        return positions if self.cp_shard is None else positions[self.cp_shard]

    @classmethod
    def from_layout(
        cls, layout: PackedPrefixLayout, attention_backend: str = "torch_ref", cp_shard: Optional[slice] = None,
        hidden_states_only: bool = False,
    ) -> "PrefixSharedPackedSeqParams":
        # megatron-core reads cu_seqlens only to apply RoPE (our attention and GDN read the layout).
        # Its THD RoPE loops over the packed sequences with a host sync per sequence; since our
        # RoPE table is already per token (PrefixSharedGPTModel), we present the whole pack as a
        # single THD sequence so RoPE is one vectorised op. The real segment boundaries live in
        # `prefix_layout.cu_seqlens` / `cu_seqlens_padded`. Under CP the single sequence is the
        # whole pack too: megatron's THD RoPE then reads this rank's entries of the table at its
        # load-balanced offsets (`PrefixSharedGPTModel`). The offsets stay on the host: that RoPE reads
        # them with `.tolist()` and `.item()` (three per call, query and key, every attention layer),
        # each a device sync when they are on the GPU (docs/how-it-works.md).
        T = layout.num_tokens
        whole = torch.tensor([0, T], dtype=layout.cu_seqlens_padded.dtype)
        return cls(
            qkv_format="thd",
            cu_seqlens_q=whole,
            cu_seqlens_kv=whole,
            cu_seqlens_q_padded=whole,
            cu_seqlens_kv_padded=whole,
            max_seqlen_q=T,
            max_seqlen_kv=T,
            prefix_layout=layout,
            attention_backend=attention_backend,
            cp_shard=cp_shard,
            output_positions=layout.local_output_positions(cp_shard),
            output_keep=layout.output_keep,
            hidden_states_only=hidden_states_only,
        )


def require_prefix_layout(packed_seq_params, where: str) -> PackedPrefixLayout:
    layout = getattr(packed_seq_params, "prefix_layout", None)
    if layout is None:
        raise ValueError(
            f"{where} is prefix-aware and needs the packed prefix layout: run the model with "
            "ps_bridge.forward.run_packed(model, layout, config), not with plain padded or THD input"
        )
    return layout
