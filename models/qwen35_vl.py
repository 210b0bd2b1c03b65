"""Qwen3.5 ConditionalGeneration (the official checkpoints) with prefix sharing, images included.

Megatron-Bridge builds these as `Qwen3VLModel`: a vision tower plus a language model whose full
attention uses mRoPE (positions `[3, B, S]`: temporal, height, width). For text tokens the three
position rows are equal, and mRoPE at equal positions is plain RoPE at that position, so a text-only
prefix-shared batch needs only the layout's per-token positions, repeated three times (the path
text-only batches take, unchanged).

A batch with images carries them in its layout (`layout.images`, `ps_bridge.images`): the vision
tower runs once over the micro-batch's distinct images, its output rows are placed at the packed
image positions (a shared prompt's image once), and every packed token gets its own mRoPE position
as transformers computes it for its sequence. Videos are refused by name.

Where Transformer Engine is absent, `Qwen3VLModel` cannot build its vision tower (it hard-codes TE
classes); `local_vision_tower()` lets it use megatron-core's local ViT modules instead. Parameter
names then differ only in the fused/separate norm form, which Megatron-Bridge's mapping aliases.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import tensor_parallel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model import Qwen3VLModel
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.text_model import Qwen3VLGPTModel
import megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model as vl_model

from ps_bridge.compat.te_placeholder import transformer_engine_installed
from ps_bridge.models.gpt_model import SelectedOutputsMixin, cp_rope_table
from ps_bridge.models.packed_seq import require_prefix_layout
from ps_bridge.models.vision_attention import VisionCoreAttention

IMAGES_REFUSED = (
    "ps-bridge takes the images of a Qwen3.5 ConditionalGeneration batch through its samples "
    "(Sample.images, ps_bridge.images.attach_images), which the packed layout carries: this call "
    "carries {what}. Videos are not supported with prefix sharing: train video data with the stock "
    "Megatron-Bridge model (without ps-bridge's provider)"
)


class PrefixSharedQwen35VLModel(Qwen3VLModel):
    """Qwen3VLModel on the packed prefix layout: mRoPE positions and images from the layout."""

    def forward(self, input_ids, position_ids=None, attention_mask=None, *args, packed_seq_params=None, **kwargs):
        for key in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw"):
            if kwargs.get(key) is not None:
                raise ValueError(IMAGES_REFUSED.format(what=key))
        layout = require_prefix_layout(packed_seq_params, "PrefixSharedQwen35VLModel")
        if layout.images is not None:
            return self._forward_with_images(input_ids, layout, packed_seq_params, **kwargs)
        # image/video placeholder tokens without pixels would silently embed as text: refuse them
        # (one device->host sync per forward; cheap next to the model)
        special = torch.tensor([self.image_token_id, self.video_token_id], device=input_ids.device)
        if torch.isin(input_ids, special).any():
            raise ValueError(IMAGES_REFUSED.format(what="image/video placeholder tokens without images"))
        # mRoPE at equal (t, h, w) positions == RoPE at the layout's per-token positions; under CP the whole
        # pack's, in the order megatron's CP RoPE reads each rank's rows (cp_rope_table)
        positions = layout.positions.to(input_ids.device)
        if packed_seq_params.cp_shard is not None:
            positions = cp_rope_table(positions, self.config.context_parallel_size)
        mrope_positions = positions.view(1, 1, -1).expand(3, 1, -1).contiguous()
        return super().forward(
            input_ids, mrope_positions, None, *args, packed_seq_params=packed_seq_params, **kwargs
        )

    def _forward_with_images(self, input_ids, layout, packed_seq_params, **kwargs):
        """The vision tower once over the layout's images, its rows placed at the packed image
        positions (`ps_bridge.images.PackedImages`), then the language model at the layout's mRoPE
        positions; the stock forward's THD path otherwise (its sequence-parallel scatter)."""
        images = layout.images
        if images.merge != self.square_merge_size ** 0.5:
            raise ValueError(f"the batch's images were counted with spatial merge size {images.merge}, "
                             f"the model's vision tower merges {int(self.square_merge_size ** 0.5)}")
        # this rank's tokens (its CP shard): their image positions and the tower rows they take
        positions, rows, _ = images.local(packed_seq_params.cp_shard)
        # the whole pack's mRoPE positions: under CP megatron's THD RoPE reads each rank's rows of the table
        # in its load-balanced order, so they are placed there (cp_rope_table, as PrefixSharedGPTModel does)
        mrope = images.mrope
        if packed_seq_params.cp_shard is not None:
            mrope = cp_rope_table(mrope.t(), self.config.context_parallel_size).t()
        # every placeholder of this rank's tokens is one the layout fills (one device->host sync)
        placeholders = torch.stack([(input_ids == self.image_token_id).sum(), (input_ids == self.video_token_id).sum()]).tolist()
        if placeholders != [positions.numel(), 0]:
            raise ValueError(IMAGES_REFUSED.format(what="image placeholders that the layout's images do not cover, or videos"))
        combined = None
        if self.pre_process:
            device = input_ids.device
            embeds, deepstack = self.vision_model(hidden_states=images.pixel_values.to(device), grid_thw=images.grid_thw)
            if deepstack:
                raise ValueError("vision towers with deepstack features are not supported with prefix sharing (Qwen3.5 has none)")
            combined = self.language_model.embedding(input_ids=input_ids, position_ids=None).clone()  # [t, 1, h]
            index = positions.to(device)
            combined = combined.index_put((index, torch.zeros_like(index)), embeds.index_select(0, rows.to(device)).to(combined.dtype))
            if self.config.sequence_parallel:
                combined = tensor_parallel.scatter_to_sequence_parallel_region(combined, group=self.pg_collection.tp).contiguous()
        self.language_model.rotary_pos_emb.is_thd_format = True
        return self.language_model(
            input_ids=input_ids,
            position_ids=mrope.to(input_ids.device).unsqueeze(1),
            attention_mask=None,
            decoder_input=combined,
            packed_seq_params=packed_seq_params,
            **kwargs,
        )


class PrefixSharedQwen3VLGPTModel(SelectedOutputsMixin, Qwen3VLGPTModel):
    """The language model of `PrefixSharedQwen35VLModel`: its output layer runs on the read positions
    only (`packed_seq_params.output_positions`), as `PrefixSharedGPTModel`'s does."""


def _local_vit_spec():
    """megatron-core's local ViT layer spec with a core attention that takes the tower's packed frames."""
    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.submodules.core_attention = VisionCoreAttention
    return spec


@contextlib.contextmanager
def local_vision_tower():
    """While building a Qwen3VLModel without TE, give its vision tower megatron's local modules."""
    if transformer_engine_installed():
        yield
        return
    saved = {
        name: getattr(vl_model, name)
        for name in ("get_vit_layer_with_transformer_engine_spec", "TENorm", "TEColumnParallelLinear", "TERowParallelLinear")
    }
    vl_model.get_vit_layer_with_transformer_engine_spec = _local_vit_spec
    vl_model.TENorm = WrappedTorchNorm
    vl_model.TEColumnParallelLinear = ColumnParallelLinear
    vl_model.TERowParallelLinear = RowParallelLinear
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(vl_model, name, value)
