"""What the bench measures: model shapes (table entries built by their family's HF-config builder),
the default grids, the ideal speed-up and the micro-batch of a grid row.

A new family (e.g. another hybrid architecture) adds one builder to `FAMILIES` and its shapes to
`MODEL_SHAPES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ps_bridge.images import SampleImage, attach_images
from ps_bridge.layout import Sample


def qwen2_hf_config(dims: dict, num_layers: int):
    # imported here: transformers is heavy
    from transformers import Qwen2Config

    cfg = Qwen2Config(**dict(dims, num_hidden_layers=num_layers))
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def qwen35_hf_config(dims: dict, num_layers: int):
    """Qwen3.5 text model (`Qwen3_5ForCausalLM`): the hybrid pattern of the real checkpoint
    (three Gated DeltaNet layers, then one full-attention layer) cut to `num_layers`."""
    # imported here: transformers is heavy
    from transformers import Qwen3_5TextConfig

    layer_types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(num_layers)]
    cfg = Qwen3_5TextConfig(**dict(dims, num_hidden_layers=num_layers, layer_types=layer_types))
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


def qwen35_moe_hf_config(dims: dict, num_layers: int):
    """Qwen3.5 MoE text model (`Qwen3_5MoeForCausalLM`), the same hybrid pattern cut to `num_layers`;
    every layer's MLP is MoE (routed experts + a gated shared expert)."""
    # imported here: transformers is heavy
    from transformers import Qwen3_5MoeTextConfig

    layer_types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(num_layers)]
    cfg = Qwen3_5MoeTextConfig(**dict(dims, num_hidden_layers=num_layers, layer_types=layer_types))
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    return cfg


def qwen35_vl_hf_config(dims: dict, num_layers: int):
    """Qwen3.5 vision-language model (`Qwen3_5ForConditionalGeneration`, what the official checkpoints
    declare): the text model of `qwen35_hf_config` cut to `num_layers`, and the vision tower of
    `dims["vision"]` (its `depth` as given: `vision_layers` cuts it)."""
    # imported here: transformers is heavy
    from transformers import Qwen3_5Config

    dims = dict(dims)
    vision = dims.pop("vision")
    special = {k: dims.pop(k) for k in list(dims) if k.endswith("_token_id")}
    tie = dims.pop("tie_word_embeddings", False)
    text = qwen35_hf_config(dims, num_layers).to_dict()
    text.pop("architectures", None)
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(vision, out_hidden_size=dims["hidden_size"]),
                        tie_word_embeddings=tie, **special)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


def standard_hf_config(config_class: str, architecture: str) -> Callable:
    """The builder of a standard-attention family (providers/gpt.py): its transformers config class
    with the dims and `num_layers` layers (Qwen3 MoE: every layer MoE unless `mlp_only_layers` says)."""

    def build(dims: dict, num_layers: int):
        # imported here: transformers is heavy
        import transformers

        cfg = getattr(transformers, config_class)(**dict(dims, num_hidden_layers=num_layers))
        cfg.architectures = [architecture]
        return cfg

    return build


# family -> builder(real dims, number of layers) -> transformers config our provider registry serves.
FAMILIES: Dict[str, Callable] = {
    "qwen2.5": qwen2_hf_config,
    "qwen3.5": qwen35_hf_config,
    "qwen3.5-moe": qwen35_moe_hf_config,
    "qwen3.5-vl": qwen35_vl_hf_config,
    "qwen3": standard_hf_config("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3-moe": standard_hf_config("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


@dataclass(frozen=True)
class ModelShape:
    family: str
    dims: dict  # the checkpoint's config.json values that set the shape
    full_layers: int
    bench_layers: int  # default layer count for the bench (fewer layers keep a grid row quick)


_QWEN25_COMMON = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)

_QWEN35_COMMON = dict(
    vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6, max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
)

_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=40960)

MODEL_SHAPES: Dict[str, ModelShape] = {
    # Qwen3 (values of the released config.json files; q/k norm per head, head_dim 128 whatever the width)
    "qwen3-0.6b": ModelShape(
        "qwen3",
        dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
             tie_word_embeddings=True),
        full_layers=28,
        bench_layers=8,
    ),
    "qwen3-8b": ModelShape(
        "qwen3",
        dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
             tie_word_embeddings=False),
        full_layers=36,
        bench_layers=4,
    ),
    "qwen3-30b-a3b": ModelShape(
        "qwen3-moe",
        dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
             num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
             decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
        full_layers=48,
        bench_layers=4,
    ),
    "qwen2.5-1.5b": ModelShape(
        "qwen2.5",
        dict(_QWEN25_COMMON, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
             num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
        full_layers=28,
        bench_layers=8,
    ),
    # Qwen2.5-0.5B: the small model of a user's first run (config.json values)
    "qwen2.5-0.5b": ModelShape(
        "qwen2.5",
        dict(_QWEN25_COMMON, vocab_size=151936, hidden_size=896, intermediate_size=4864,
             num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
        full_layers=24,
        bench_layers=24,
    ),
    "qwen2.5-7b": ModelShape(
        "qwen2.5",
        dict(_QWEN25_COMMON, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
             num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
        full_layers=28,
        bench_layers=4,
    ),
    # Qwen3.5 text models (values of the released config.json files; GDN + gated attention)
    "qwen3.5-0.8b": ModelShape(
        "qwen3.5",
        dict(_QWEN35_COMMON, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
             num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True),
        full_layers=24,
        bench_layers=8,
    ),
    "qwen3.5-9b": ModelShape(
        "qwen3.5",
        dict(_QWEN35_COMMON, hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
             num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False),
        full_layers=32,
        bench_layers=4,
    ),
    # Qwen3.5-9B as released (`Qwen3_5ForConditionalGeneration`): the text model above and its vision
    # tower. Tower values: transformers 5.10's Qwen3_5VisionConfig defaults (depth 27 and hidden 1152 as
    # Megatron-Bridge's Qwen35VLModelProvider has them for the dense models; intermediate 4304, 16 heads,
    # patch 16, temporal patch 2, spatial merge 2, 2304 position embeddings: assumed equal to the release,
    # not read from its config.json here); the tower's output width is the text hidden size. mRoPE
    # sections [11, 11, 10] interleaved (Megatron-Bridge's default for Qwen3.5) over the 64 rotary dims.
    "qwen3.5-9b-vl": ModelShape(
        "qwen3.5-vl",
        dict(_QWEN35_COMMON, hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
             num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False,
             rope_parameters=dict(_QWEN35_COMMON["rope_parameters"], mrope_section=[11, 11, 10], mrope_interleaved=True),
             image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054,
             vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                         temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=2304)),
        full_layers=32,
        bench_layers=4,
    ),
    # Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults (written out; no hub access needed)
    "qwen3.5-35b-a3b": ModelShape(
        "qwen3.5-moe",
        dict(vocab_size=248320, hidden_size=2048, head_dim=256, num_attention_heads=16, num_key_value_heads=2,
             linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
             moe_intermediate_size=512, shared_expert_intermediate_size=512, tie_word_embeddings=False),
        full_layers=40,
        bench_layers=4,
    ),
    "tiny-qwen3.5-moe": ModelShape(
        "qwen3.5-moe",
        dict(_QWEN35_COMMON, vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, max_position_embeddings=512, tie_word_embeddings=False),
        full_layers=4,
        bench_layers=4,
    ),
    "tiny-qwen3.5": ModelShape(
        "qwen3.5",
        dict(_QWEN35_COMMON, vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512, tie_word_embeddings=False),
        full_layers=4,
        bench_layers=4,
    ),
    # CPU runs of the image-prompt bench path: tiny-qwen3.5 with a two-layer vision tower (patch 4, merge 2)
    "tiny-qwen3.5-vl": ModelShape(
        "qwen3.5-vl",
        dict(_QWEN35_COMMON, vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
             image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
             vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                         temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)),
        full_layers=4,
        bench_layers=4,
    ),
    # CPU runs of the standard-attention families' bench path (head_dim not hidden / heads)
    "tiny-qwen3": ModelShape(
        "qwen3",
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False),
        full_layers=2,
        bench_layers=2,
    ),
    "tiny-qwen3-moe": ModelShape(
        "qwen3-moe",
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
             max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False),
        full_layers=2,
        bench_layers=2,
    ),
    # --smoke: Qwen2-shaped and tiny
    "tiny-qwen2.5": ModelShape(
        "qwen2.5",
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False),
        full_layers=2,
        bench_layers=2,
    ),
}

DEFAULT_MODELS = ("qwen2.5-1.5b", "qwen2.5-7b", "qwen3.5-0.8b", "qwen3.5-9b")
DEFAULT_GRID: Tuple[Tuple[int, int, int], ...] = ((2048, 512, 8), (4096, 256, 16), (1024, 1024, 8), (512, 4096, 8))
SMOKE_GRID: Tuple[Tuple[int, int, int], ...] = ((24, 8, 4), (8, 24, 2))


def is_vision_language(shape: ModelShape) -> bool:
    return "vision" in shape.dims


def vision_depth(shape: ModelShape, layers: int, vision_layers: Optional[int] = None) -> int:
    """The vision tower's depth in a bench model of `layers` text layers: `vision_layers`, else the
    tower's depth cut in the text model's proportion (a 4-of-32-layer Qwen3.5-9B: 3 of 27), so that the
    tower's share of the step stays that of the whole model."""
    if vision_layers is not None:
        return vision_layers
    return max(1, round(shape.dims["vision"]["depth"] * layers / shape.full_layers))


def shape_hf_config(shape: ModelShape, layers: int, vision_layers: Optional[int] = None):
    """The transformers config of `shape` with `layers` text layers (and a vision tower of
    `vision_depth(...)` layers where the shape has one)."""
    dims = shape.dims
    if is_vision_language(shape):
        dims = dict(dims, vision=dict(dims["vision"], depth=vision_depth(shape, layers, vision_layers)))
    return FAMILIES[shape.family](dims, layers)


def ideal_speedup(P: int, R: int, n: int) -> float:
    return n * (P + R) / (P + n * R)


def make_samples(P: int, R: int, n: int, groups: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(groups):
        prompt = torch.randint(vocab, (P,), generator=g).tolist()
        for _ in range(n):
            samples.append(Sample(prompt, torch.randint(vocab, (R,), generator=g).tolist()))
    return samples


@dataclass(frozen=True)
class ImagePrompts:
    """`--images K --image-size HxW`: every prompt carries K images of its own (random pixels) of
    H x W pixels, each `<vision_start> <image_pad> x tokens <vision_end>`, before its P text tokens."""

    per_prompt: int
    height: int
    width: int

    def grid(self, vision: dict) -> Tuple[int, int, int]:
        """The image's patch grid (t, h, w): one temporal patch (a still image is its frame repeated,
        as the image processor does), H / patch x W / patch."""
        patch, merge = vision["patch_size"], vision["spatial_merge_size"]
        if self.height % (patch * merge) or self.width % (patch * merge):
            raise ValueError(f"--image-size {self.height}x{self.width}: each side must be a multiple of patch x merge "
                             f"= {patch * merge} pixels (the image processor resizes to one)")
        return 1, self.height // patch, self.width // patch

    def tokens_per_image(self, vision: dict) -> int:
        t, h, w = self.grid(vision)
        return t * h * w // vision["spatial_merge_size"] ** 2

    def prompt_tokens(self, P: int, vision: dict) -> int:
        """A prompt's whole length: its images with their start/end tokens, then P text tokens."""
        return self.per_prompt * (self.tokens_per_image(vision) + 2) + P


# a vision-language config's special token ids (text tokens are drawn below all of them)
VISION_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def random_images(images: ImagePrompts, vision: dict, g: torch.Generator) -> List[SampleImage]:
    """One prompt's `images.per_prompt` images: random patch rows `[t*h*w, C*T*P*P]` of its grid."""
    t, h, w = images.grid(vision)
    row = vision.get("in_channels", 3) * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    return [SampleImage.of(torch.randn(t * h * w, row, generator=g), (t, h, w)) for _ in range(images.per_prompt)]


def image_tokens(pictures: List[SampleImage], ids: dict, vision: dict) -> List[int]:
    """The prompt tokens of `pictures`: per image `<vision_start> <image_pad> x tokens <vision_end>`."""
    out: List[int] = []
    for p in pictures:
        out += ([ids["vision_start_token_id"]] + [ids["image_token_id"]] * p.num_tokens(vision["spatial_merge_size"])
                + [ids["vision_end_token_id"]])
    return out


def make_image_samples(P: int, R: int, n: int, groups: int, dims: dict, images: ImagePrompts, seed: int) -> List[Sample]:
    """`make_samples` with image prompts (`ImagePrompts`): each prompt's images random and its own, the
    same in its n samples. Text tokens are drawn below the vision special ids (a random text token equal
    to the image placeholder would be an image token without pixels)."""
    vision = dims["vision"]
    ids = {k: dims[k] for k in VISION_IDS}
    text = min(ids.values())
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(groups):
        pictures = random_images(images, vision, g)
        prompt = image_tokens(pictures, ids, vision) + torch.randint(text, (P,), generator=g).tolist()
        for _ in range(n):
            sample = Sample(prompt, torch.randint(text, (R,), generator=g).tolist())
            samples.append(attach_images(sample, pictures, image_token_id=ids["image_token_id"],
                                         merge=vision["spatial_merge_size"], video_token_id=ids["video_token_id"],
                                         index=len(samples)))
    return samples


def response_row_mask(layout) -> torch.Tensor:
    """True at the row positions that hold a response token's log-prob (P-1 .. P+R-2 per sample)."""
    mask = torch.zeros(int(layout.row_offsets[-1]), dtype=torch.bool)
    offsets = layout.row_offsets.tolist()
    for i in range(layout.num_samples):
        P = int(layout.sample_prompt_length[i])
        R = int(layout.sample_response_length[i])
        mask[offsets[i] + P - 1 : offsets[i] + P - 1 + R] = True
    return mask


# ---- prefix-tree rows (`--trees`): micro-batches shaped like the workloads that share at several levels ----


def _tokens(g: torch.Generator, vocab: int, n: int) -> list:
    return torch.randint(vocab, (n,), generator=g).tolist()


def system_samples(vocab: int, seed: int, system: int, prompts: int, prompt: int, n: int, response: int):
    """A system prompt of `system` tokens shared by `prompts` prompts of `prompt` tokens after it,
    each with `n` responses of `response` tokens (a tree of depth 2)."""
    g = torch.Generator().manual_seed(seed)
    head = _tokens(g, vocab, system)
    samples = []
    for _ in range(prompts):
        p = head + _tokens(g, vocab, prompt)
        samples += [Sample(p, _tokens(g, vocab, response)) for _ in range(n)]
    return samples


def chain_samples(vocab: int, seed: int, prompt: int, trajectories: int, turns: int, observation: int, response: int):
    """Multi-turn trajectories trained step-wise: a prompt of `prompt` tokens shared by
    `trajectories` trajectories of `turns` turns (an observation, then a response); each turn is a
    sample whose prompt is the whole trajectory so far and whose response is the turn's response
    (the samples of one trajectory are one path of the tree: depth 1)."""
    g = torch.Generator().manual_seed(seed)
    head = _tokens(g, vocab, prompt)
    samples = []
    for _ in range(trajectories):
        so_far = list(head)
        for _ in range(turns):
            so_far += _tokens(g, vocab, observation)
            r = _tokens(g, vocab, response)
            samples.append(Sample(list(so_far), r))
            so_far += r
    return samples


def search_samples(vocab: int, seed: int, prompt: int, depth: int, branching: int, node: int):
    """A search tree: a prompt of `prompt` tokens, then `depth` levels of `branching` children of
    `node` tokens each; one sample per node, its prompt the path above the node and its response the
    node's tokens (a tree of depth `depth`)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    frontier = [_tokens(g, vocab, prompt)]
    for _ in range(depth):
        children = []
        for path in frontier:
            for _ in range(branching):
                r = _tokens(g, vocab, node)
                samples.append(Sample(list(path), r))
                children.append(path + r)
        frontier = children
    return samples


def template_samples(vocab: int, seed: int, prompts: int, prompt: int, template: int, n: int, response: int):
    """`prompts` prompts of `prompt` tokens that share only their first `template` tokens, each with
    `n` responses of `response` tokens: the prompts' first tokens after the template differ, and so do
    the first tokens of a prompt's responses, so the only run shared across prompts is the template
    (a token trie of depth 2 when it is shared, `--min-shared-sweep`: 1 template node, `prompts`
    prompt nodes, `prompts * n` response leaves; depth 1 without it)."""
    if not 1 <= template < prompt:
        raise ValueError(f"the template ({template} tokens) must be shorter than the prompt ({prompt}) and non-empty")
    if max(prompts, n) > vocab:
        raise ValueError(f"{prompts} prompts and {n} responses need that many distinct tokens; the vocabulary has {vocab}")
    g = torch.Generator().manual_seed(seed)
    head = _tokens(g, vocab, template)
    firsts = torch.randperm(vocab, generator=g)[:prompts].tolist()  # where the prompts diverge
    samples = []
    for first in firsts:
        p = head + [first] + _tokens(g, vocab, prompt - template - 1)
        starts = torch.randperm(vocab, generator=g)[:n].tolist()  # where its responses diverge
        samples += [Sample(p, [s] + _tokens(g, vocab, response - 1)) for s in starts]
    return samples


# `--min-shared-sweep`'s run lengths and grid when none are given (the default threshold,
# `layout.DEFAULT_MIN_SHARED`, is 64); with --smoke a tiny grid row and runs (P must exceed twice the run)
MIN_SHARED_SWEEP: Tuple[int, ...] = (4, 8, 16, 32, 64)
MIN_SHARED_GRID: Tuple[Tuple[int, int, int], ...] = ((512, 128, 8),)
MIN_SHARED_SMOKE: Tuple[Tuple[Tuple[int, int, int], ...], Tuple[int, ...]] = (((24, 4, 2),), (4, 8))


@dataclass(frozen=True)
class TreeShape:
    """A named prefix-tree micro-batch (`--trees NAME`): its builder and sizes, and tiny sizes for
    `--smoke`."""

    build: Callable
    sizes: dict
    smoke_sizes: dict
    description: str

    def samples(self, vocab: int, seed: int, smoke: bool = False) -> list:
        return self.build(vocab, seed, **(self.smoke_sizes if smoke else self.sizes))


TREE_SHAPES: Dict[str, TreeShape] = {
    "system": TreeShape(
        system_samples, dict(system=4096, prompts=16, prompt=256, n=8, response=512),
        dict(system=68, prompts=3, prompt=66, n=2, response=5),  # shared runs above layout.DEFAULT_MIN_SHARED
        "system prompt 4096 shared by 16 prompts of 256, n = 8, R = 512",
    ),
    "chain": TreeShape(
        chain_samples, dict(prompt=2048, trajectories=4, turns=8, observation=512, response=256),
        dict(prompt=66, trajectories=2, turns=3, observation=4, response=3),
        "prompt 2048 shared by 4 trajectories of 8 turns (observation 512 + response 256), a sample per turn",
    ),
    "search": TreeShape(
        search_samples, dict(prompt=2048, depth=3, branching=4, node=1024),
        dict(prompt=66, depth=3, branching=2, node=16),
        "prompt 2048, depth 3, branching 4, nodes of 1024, a sample per node",
    ),
}
