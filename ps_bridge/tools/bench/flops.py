"""Model FLOPs of a packed micro-batch, and F: the unshared computation's FLOPs over the shared one's.

`F = flop_ratio(shape, samples)` is what prefix sharing can at most gain in compute: the FLOPs of
the unshared computation (every sample its own sequence, the output layer on every position, as
verl's stock engine runs it) over those of the shared one (each trie token once, attention over its
ancestors, the output layer on the read positions only). With the output layer on read positions
the speed-up can exceed the token ratio S; F is its bound.

Conventions (`model_flops`):
- a matmul of `[m, k] x [k, n]` is `2 m k n` FLOPs; forward + backward = 3 x forward for every
  linear layer (the backward computes the input's and the weight's gradients);
- attention's quadratic term as flash-attention's benchmarks count it: `4 d` FLOPs per (query head,
  query, key) pair (QK^T and PV), causal pairs counted as half a square: a segment of `n` queries
  with `A` ancestor tokens has `n A + n^2 / 2` pairs; backward = 2.5 x forward (3.5 x in all);
- Gated DeltaNet: the per-token state update, per value head `6 K V` (the decayed state applied to
  k, the rank-one update, the output q^T S: `2 K V` each) plus the depthwise conv `2 W` per conv
  channel; 3 x forward;
- MoE: the router, the top-k active experts and the shared expert per token (3 x forward);
- the vision tower (vision-language models), once per image it runs on (`layout.images`: a shared
  layout's distinct images, an unshared one's every occurrence, as the stock model runs them): the
  patch embedding (a `C*T*P*P -> hidden` linear layer per patch), per layer the QKV and output
  projections and the MLP (`4 h^2 + 2 h I` per patch) and bidirectional attention within each frame
  (`4 h` per (query, key) pair over all heads, a frame of `N` patches has `N^2` pairs), the patch
  merger (`(m^2 h)^2 + m^2 h * out` per merged token); linear layers 3 x forward (the patch
  embedding's input gradient is counted too, as for every linear layer), attention 3.5 x forward;
- the embedding lookup, norms, rotary embedding, activations and the softmax are not counted;
- padding counted as computed: linear layers run on every packed position, padding included, and
  attention's queries on the padded segments; the Gated DeltaNet kernels run on compacted (valid)
  tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from ps_bridge.layout import PackedPrefixLayout, Sample, build_layout
from ps_bridge.tools.bench.catalog import shape_hf_config

MATMUL_FWD_BWD = 3.0  # forward + backward of a linear layer, in forwards
ATTENTION_FWD_BWD = 3.5  # flash-attention's count: backward = 2.5 x forward


@dataclass(frozen=True)
class VisionFlopShape:
    """What the count needs from a vision tower (`transformers` vision config fields)."""

    hidden: int
    intermediate: int
    depth: int
    patch_inputs: int  # in_channels * temporal_patch_size * patch_size^2
    merge: int
    out_hidden: int

    @classmethod
    def of(cls, v) -> "VisionFlopShape":
        return cls(hidden=v.hidden_size, intermediate=v.intermediate_size, depth=v.depth,
                   patch_inputs=v.in_channels * v.temporal_patch_size * v.patch_size ** 2,
                   merge=v.spatial_merge_size, out_hidden=v.out_hidden_size)

    def image_flops(self, grid_thw) -> float:
        """Forward + backward FLOPs of the tower on one image of patch grid (t, h, w)."""
        t, gh, gw = (int(x) for x in grid_thw)
        patches, frame = t * gh * gw, gh * gw
        h, m2 = self.hidden, self.merge ** 2
        linear = patches * self.patch_inputs * h + self.depth * patches * (4 * h * h + 2 * h * self.intermediate)
        linear += patches // m2 * ((m2 * h) ** 2 + m2 * h * self.out_hidden)
        attention = self.depth * 4.0 * h * t * frame * frame
        return MATMUL_FWD_BWD * 2.0 * linear + ATTENTION_FWD_BWD * attention


@dataclass(frozen=True)
class FlopShape:
    """What the count needs from a model (`flop_shape` reads it off a bench `ModelShape`)."""

    hidden: int
    vocab: int
    layer_kinds: Sequence[str]  # "attention" or "gdn", per layer
    heads: int
    kv_heads: int
    head_dim: int
    attention_output_gate: bool = False  # Qwen3.5: q_proj also projects a per-head output gate
    intermediate: int = 0  # dense gated MLP (SwiGLU: three h x I matmuls)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    gdn_key_heads: int = 0
    gdn_value_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0
    gdn_conv_width: int = 0
    vision: Optional[VisionFlopShape] = None  # a vision-language model's tower

    def routed_expert_flops_per_token(self) -> float:
        """Forward FLOPs per token of one layer's top-k routed experts (0 for a dense model)."""
        return 2.0 * 3 * self.hidden * self.expert_intermediate * self.experts_per_token if self.experts else 0.0

    def linear_flops_per_token(self, kind: str) -> float:
        """Forward FLOPs of one layer's linear layers (and MoE experts) per token."""
        h = self.hidden
        if kind == "attention":
            q = self.heads * self.head_dim * (2 if self.attention_output_gate else 1)
            kv = 2 * self.kv_heads * self.head_dim
            mixer = h * (q + kv) + self.heads * self.head_dim * h
        elif kind == "gdn":
            qk = 2 * self.gdn_key_heads * self.gdn_key_dim
            v = self.gdn_value_heads * self.gdn_value_dim
            mixer = h * (qk + 2 * v + 2 * self.gdn_value_heads) + v * h  # in_proj (qkv, z, b, a), out_proj
        else:
            raise ValueError(f"unknown layer kind {kind!r} (attention or gdn)")
        if self.experts:
            mlp = h * self.experts + 3 * h * self.expert_intermediate * self.experts_per_token
            if self.shared_expert_intermediate:
                mlp += 3 * h * self.shared_expert_intermediate + h  # and its sigmoid gate
        else:
            mlp = 3 * h * self.intermediate
        return 2.0 * (mixer + mlp)

    def gdn_flops_per_token(self) -> float:
        conv_channels = 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim
        return 6.0 * self.gdn_value_heads * self.gdn_key_dim * self.gdn_value_dim + 2.0 * self.gdn_conv_width * conv_channels


def flop_shape(model, num_layers: Optional[int] = None, vision_layers: Optional[int] = None) -> FlopShape:
    """The `FlopShape` of a bench `ModelShape` (`ps_bridge.tools.bench.catalog.MODEL_SHAPES`) with
    `num_layers` layers (default: its bench layer count) and a vision tower of `vision_layers`
    (`catalog.vision_depth`), read off the transformers config the bench builds for it (defaults
    included; Qwen3.5's hybrid pattern cut to the layers)."""
    layers = model.bench_layers if num_layers is None else num_layers
    family = "qwen3.5" if model.family == "qwen3.5-vl" else model.family
    return flop_shape_of_config(shape_hf_config(model, layers, vision_layers), family)


def flop_shape_of_config(c, family: Optional[str] = None) -> FlopShape:
    """The `FlopShape` of a transformers text config `c` (all its layers), or of a vision-language
    config (its text config, and its vision tower). `family`: "qwen2.5",
    "qwen3", "llama3", "qwen3-moe", "qwen3.5" or "qwen3.5-moe"; None reads it off the config (Gated DeltaNet fields: Qwen3.5, experts:
    its MoE)."""
    vision_config = getattr(c, "vision_config", None)
    if vision_config is not None:
        return replace(flop_shape_of_config(c.get_text_config(), family), vision=VisionFlopShape.of(vision_config))
    if family is None:
        gdn_config = hasattr(c, "linear_num_key_heads")
        moe = bool(getattr(c, "num_experts", 0))
        family = ("qwen3.5-moe" if moe else "qwen3.5") if gdn_config else ("qwen3-moe" if moe else "qwen2.5")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    common = dict(hidden=c.hidden_size, vocab=c.vocab_size, heads=c.num_attention_heads,
                  kv_heads=c.num_key_value_heads, head_dim=head_dim)
    if family in ("qwen2.5", "qwen3", "llama3"):
        return FlopShape(layer_kinds=["attention"] * c.num_hidden_layers, intermediate=c.intermediate_size, **common)
    if family == "qwen3-moe":
        if getattr(c, "mlp_only_layers", None) or int(getattr(c, "decoder_sparse_step", 1) or 1) != 1:
            raise ValueError("the FLOP count takes every layer's MLP to be MoE: dense layers among MoE layers "
                             "(mlp_only_layers, decoder_sparse_step) are not counted")
        return FlopShape(layer_kinds=["attention"] * c.num_hidden_layers, experts=c.num_experts,
                         experts_per_token=c.num_experts_per_tok, expert_intermediate=c.moe_intermediate_size, **common)
    kinds = ["attention" if t == "full_attention" else "gdn" for t in c.layer_types[: c.num_hidden_layers]]
    gdn = dict(gdn_key_heads=c.linear_num_key_heads, gdn_value_heads=c.linear_num_value_heads,
               gdn_key_dim=c.linear_key_head_dim, gdn_value_dim=c.linear_value_head_dim,
               gdn_conv_width=c.linear_conv_kernel_dim)
    if family == "qwen3.5-moe":
        return FlopShape(layer_kinds=kinds, attention_output_gate=True, experts=c.num_experts,
                         experts_per_token=c.num_experts_per_tok, expert_intermediate=c.moe_intermediate_size,
                         shared_expert_intermediate=getattr(c, "shared_expert_intermediate_size", 0) or 0,
                         **gdn, **common)
    return FlopShape(layer_kinds=kinds, attention_output_gate=True, intermediate=c.intermediate_size, **gdn, **common)


def attention_pairs(layout: PackedPrefixLayout) -> float:
    """(query, key) pairs of one attention layer, flash-attention style: each segment's padded
    queries against its ancestors' valid tokens, plus half the square of its own (causal)."""
    valid = layout.host["valid_lengths"]
    padded = layout.host["padded_lengths"]
    parent = layout.host["segment_parent"]
    above: List[int] = []  # valid tokens of each segment's ancestors (parents come first in the pack)
    pairs = 0.0
    for s, p in enumerate(parent):
        above.append(0 if p < 0 else above[p] + valid[p])
        pairs += padded[s] * above[s] + padded[s] ** 2 / 2
    return pairs


# the kinds of work `flops_by_kind` counts apart, as profilers group the kernels that do them
FLOP_KINDS: Tuple[str, ...] = ("dense", "experts", "attention", "gdn", "vision")


def output_positions(layout: PackedPrefixLayout) -> int:
    """How many positions the output layer runs on (`PackedPrefixLayout.logit_positions`: the read
    positions, of a bucketed layout those rows read; or every position)."""
    positions = layout.logit_positions()
    return layout.num_tokens if positions is None else int(positions.numel())


def flops_by_kind(shape: FlopShape, layout: PackedPrefixLayout) -> Dict[str, float]:
    """Forward + backward FLOPs of the model on `layout` (see the module's conventions) by kind of work
    (`FLOP_KINDS`): "dense" the dense matmuls (projections, dense MLPs, the router and the shared
    expert, the output layer), "experts" the routed experts, "attention" the quadratic term, "gdn" the
    delta rule's state update and the conv, "vision" the vision tower."""
    T = layout.num_tokens
    valid_tokens = sum(layout.host["valid_lengths"])
    pairs = attention_pairs(layout)
    flops = dict.fromkeys(FLOP_KINDS, 0.0)
    for kind in shape.layer_kinds:
        experts = MATMUL_FWD_BWD * T * shape.routed_expert_flops_per_token()
        flops["experts"] += experts
        flops["dense"] += MATMUL_FWD_BWD * T * shape.linear_flops_per_token(kind) - experts
        if kind == "attention":
            flops["attention"] += ATTENTION_FWD_BWD * 4.0 * shape.heads * shape.head_dim * pairs
        else:
            flops["gdn"] += MATMUL_FWD_BWD * valid_tokens * shape.gdn_flops_per_token()
    flops["dense"] += MATMUL_FWD_BWD * 2.0 * shape.hidden * shape.vocab * output_positions(layout)
    flops["vision"] = vision_flops(shape, layout)
    return flops


def model_flops(shape: FlopShape, layout: PackedPrefixLayout) -> float:
    """Forward + backward FLOPs of the model on `layout`: the sum of `flops_by_kind`."""
    return sum(flops_by_kind(shape, layout).values())


def vision_flops(shape: FlopShape, layout: PackedPrefixLayout) -> float:
    """Forward + backward FLOPs of the vision tower on the images `layout` runs it on (0 without)."""
    images = getattr(layout, "images", None)
    if images is None or images.num_images == 0:
        return 0.0
    if shape.vision is None:
        raise ValueError("the layout carries images but the FLOP shape has no vision tower")
    return sum(shape.vision.image_flops(g) for g in images.grid_thw.tolist())


def layout_flop_ratio(shape: FlopShape, shared, unshared: PackedPrefixLayout) -> float:
    """F of two packings of the same samples: `model_flops(unshared) / model_flops(shared)` (the
    bench passes the layouts it times). `shared`: one layout, or the micro-batches the samples were
    split into (each computing its own prefixes), whose FLOPs add up."""
    parts = list(shared) if isinstance(shared, (list, tuple)) else [shared]
    if unshared.shared or unshared.tokens_unshared != sum(p.tokens_unshared for p in parts):
        raise ValueError("layout_flop_ratio needs an unshared layout (share=False) of the shared layout's samples")
    return model_flops(shape, unshared) / sum(model_flops(shape, p) for p in parts)


def flop_ratio(shape: FlopShape, samples: Sequence[Sample], share="tree", pad_multiple: int = 1, **layout_options) -> float:
    """F: FLOPs of the unshared computation (every sample its own sequence, the output layer on
    every position) over those of the shared one (`share`, the output layer on read positions)."""
    shared = build_layout(samples, share=share, pad_multiple=pad_multiple, prompt_values=False, **layout_options)
    unshared = build_layout(samples, share=False, pad_multiple=pad_multiple)
    return layout_flop_ratio(shape, shared, unshared)
