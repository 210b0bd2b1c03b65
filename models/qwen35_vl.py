"""Qwen3.5 ConditionalGeneration (the official checkpoints): text-only batches with prefix sharing.

Megatron-Bridge builds these as `Qwen3VLModel`: a vision tower plus a language model whose full
attention uses mRoPE (positions `[3, B, S]`: temporal, height, width). For text tokens the three
position rows are equal, and mRoPE at equal positions is plain RoPE at that position, so a text-only
prefix-shared batch needs only the layout's per-token positions, repeated three times.

`PrefixSharedQwen35VLModel` (the class our provider gives the stock-built `Qwen3VLModel`) does
exactly that and refuses batches with images or videos: the vision encoder would have to run once
per group and its embeddings be scattered into the shared prompt, which this version does not do.
The vision tower is still built, loaded and exported unchanged (its weights round-trip).

Where Transformer Engine is absent, `Qwen3VLModel` cannot build its vision tower (it hard-codes TE
classes); `local_vision_tower()` lets it use megatron-core's local ViT modules instead. Parameter
names then differ only in the fused/separate norm form, which Megatron-Bridge's mapping aliases.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model import Qwen3VLModel
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.text_model import Qwen3VLGPTModel

from ps_bridge.models.gpt_model import SelectedOutputsMixin
from ps_bridge.models.packed_seq import require_prefix_layout

IMAGES_REFUSED = (
    "ps-bridge supports text-only batches for Qwen3.5 ConditionalGeneration checkpoints: this batch "
    "carries {what}. Train multimodal data with the stock Megatron-Bridge model (without ps-bridge's "
    "provider); the vision tower's weights are loaded and exported unchanged either way"
)


class PrefixSharedQwen35VLModel(Qwen3VLModel):
    """Qwen3VLModel whose text positions come from the packed prefix layout; images refused."""

    def forward(self, input_ids, position_ids=None, attention_mask=None, *args, packed_seq_params=None, **kwargs):
        for key in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw"):
            if kwargs.get(key) is not None:
                raise ValueError(IMAGES_REFUSED.format(what=key))
        layout = require_prefix_layout(packed_seq_params, "PrefixSharedQwen35VLModel")
        # image/video placeholder tokens without pixels would silently embed as text: refuse them
        # (one device->host sync per forward; cheap next to the model)
        special = torch.tensor([self.image_token_id, self.video_token_id], device=input_ids.device)
        if torch.isin(input_ids, special).any():
            raise ValueError(IMAGES_REFUSED.format(what="image/video placeholder tokens"))
        # mRoPE at equal (t, h, w) positions == RoPE at the layout's per-token positions
        positions = layout.positions.to(input_ids.device)
        mrope_positions = positions.view(1, 1, -1).expand(3, 1, -1).contiguous()
        return super().forward(
            input_ids, mrope_positions, None, *args, packed_seq_params=packed_seq_params, **kwargs
        )


class PrefixSharedQwen3VLGPTModel(SelectedOutputsMixin, Qwen3VLGPTModel):
    """The language model of `PrefixSharedQwen35VLModel`: its output layer runs on the read positions
    only (`packed_seq_params.output_positions`), as `PrefixSharedGPTModel`'s does."""


@contextlib.contextmanager
def local_vision_tower():
    """While building a Qwen3VLModel without TE, give its vision tower megatron's local modules."""
    from ps_bridge.compat.te_placeholder import transformer_engine_installed

    if transformer_engine_installed():
        yield
        return
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    import megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model as vl_model

    saved = {
        name: getattr(vl_model, name)
        for name in ("get_vit_layer_with_transformer_engine_spec", "TENorm", "TEColumnParallelLinear", "TERowParallelLinear")
    }
    vl_model.get_vit_layer_with_transformer_engine_spec = get_vit_layer_with_local_spec
    vl_model.TENorm = WrappedTorchNorm
    vl_model.TEColumnParallelLinear = ColumnParallelLinear
    vl_model.TERowParallelLinear = RowParallelLinear
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(vl_model, name, value)
