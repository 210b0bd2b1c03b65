"""What differs between the Megatron-Bridge releases ps-bridge runs on (0.5.0 - 0.6.2).

- Which key a bridge is dispatched on: 0.5.x registers its stock Qwen bridges under the transformers
  class (`source=Qwen3_5ForCausalLM`) and `AutoBridge` looks the architecture up as that class when
  transformers has it; 0.6.x registers and looks up by class name. Megatron-Bridge's dispatch takes
  an exact key before a name, so ours must sit under both keys to replace the stock bridge on either
  release (`dispatch_sources`).
- How routed MoE experts are mapped: 0.5.x maps Qwen3.5 MoE decoder experts as fused tensors only;
  0.6 follows the checkpoint's layout (`experts_as_stored`).
- Which layers are Gated DeltaNet: 0.5.x reads the HF config's `layer_types` as one interval (the
  first full-attention layer's index + 1), so a checkpoint whose layer kinds are not periodic gets the
  wrong kind at some layers; 0.6 takes the per-layer list (`exact_attention_pattern`).
- The Qwen3.5 ConditionalGeneration (VL) model: on 0.5.x our prefix-shared run of it gave gradients
  that differ from the unshared run (relative 0.61, tests/test_qwen35_model.py's VL cases, cause not
  found), so it is refused there (`vl_refusal`); the text-only models are unaffected.
- Qwen3 MoE's router: 0.5.x's `Qwen3MoEBridge.provider_bridge` (megatron/bridge/models/qwen/
  qwen3_moe_bridge.py) sets `moe_router_pre_softmax=False` whatever the checkpoint's
  `norm_topk_prob`, right only where it is true; 0.6 sets `not norm_topk_prob`
  (`router_softmax_from_config` does that on both).
- Llama 3 RoPE scaling: both releases' `LlamaBridge.provider_bridge` (megatron/bridge/models/llama/
  llama_bridge.py) keep the `llama3` factor only, and megatron-core's `RotaryEmbedding._apply_scaling`
  (megatron/core/models/common/embeddings/rotary_pos_embedding.py) fixes low_freq_factor=1,
  high_freq_factor=4, original_max_position_embeddings=8192; a checkpoint with other values gets other
  frequencies than Hugging Face's. `llama3_rope_parameters` keeps the checkpoint's, `llama3_inv_freq`
  computes the frequencies from them (the standard provider sets them on the model).
- The Qwen3.5 vision tower's patch merger: 0.6.2's `Qwen3VLVisionPatchMerger`
  (megatron/bridge/models/qwen_vl/modelling_qwen3_vl/utils.py:154) takes the tower's activation,
  tanh-approximated GELU, where transformers' `Qwen3_5VisionPatchMerger`
  (transformers/models/qwen3_5/modeling_qwen3_5.py:882, 5.10) applies exact `nn.GELU()`: image
  embeddings 6e-5 relative off Hugging Face's, vision-tower gradients 1e-4 (float64 too).
  `exact_gelu_merger` gives the built model's merger the exact GELU.
"""

from __future__ import annotations

import importlib.metadata
import math
import re
from typing import List, Optional

from packaging.version import Version

VL_SINCE = "0.6.0"


def installed_version() -> str:
    try:
        return importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:  # unpacked without its metadata: the newest layout
        return VL_SINCE


def vl_refusal() -> Optional[str]:
    """Why the Qwen3.5 ConditionalGeneration (VL) provider is refused on this Megatron-Bridge, or None."""
    version = installed_version()
    if Version(version) >= Version(VL_SINCE):
        return None
    return (
        f"Qwen3.5 ConditionalGeneration (VL) checkpoints are refused on Megatron-Bridge {version}: there "
        "the prefix-shared gradients differ from the unshared run (docs/install.md). Fix: install "
        f"megatron-bridge>={VL_SINCE} (`pip install --no-deps megatron-bridge==0.6.2`), or train the "
        "text-only model (a Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM checkpoint)."
    )


def hf_rope_type(hf_config) -> str:
    """The HF config's RoPE type (`rope_scaling` / transformers 5's `rope_parameters`), "default" when none."""
    for key in ("rope_scaling", "rope_parameters"):
        params = getattr(hf_config, key, None)
        if isinstance(params, dict) and (params.get("rope_type") or params.get("type")):
            return str(params.get("rope_type") or params.get("type"))
    return "default"


def llama3_rope_parameters(hf_config) -> Optional[tuple]:
    """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of a `llama3`
    RoPE scaling in the HF config, or None."""
    if hf_rope_type(hf_config) != "llama3":
        return None
    params = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None)
    return (float(params.get("factor", 8.0)), float(params.get("low_freq_factor", 1.0)),
            float(params.get("high_freq_factor", 4.0)), float(params.get("original_max_position_embeddings", 8192)))


def llama3_inv_freq(dim: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: float):
    """RoPE inverse frequencies of `dim` rotary channels with llama3 scaling: wavelengths longer than
    original / low_freq_factor are divided by `factor`, shorter than original / high_freq_factor kept,
    those between interpolated linearly in original / wavelength."""
    # imported here: torch is heavy
    import torch

    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelength = 2 * math.pi / inv_freq
    ratio = original_max_position_embeddings / wavelength
    smooth = ((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    low = wavelength > original_max_position_embeddings / low_freq_factor
    high = wavelength < original_max_position_embeddings / high_freq_factor
    return torch.where(low, inv_freq / factor, torch.where(high, inv_freq, scaled))


def linear_rope_factor(hf_config):
    """The factor of a `linear` RoPE scaling in the HF config (positions divided by it), or None.
    Megatron-Bridge 0.6's `LlamaBridge` sets it as `seq_len_interpolation_factor`; 0.5.x's and the Qwen3
    bridges of both releases drop it."""
    if hf_rope_type(hf_config) != "linear":
        return None
    params = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None)
    return float(params["factor"])


def router_softmax_from_config(provider, hf_config) -> None:
    """A top-k router's `moe_router_pre_softmax` from the HF config's `norm_topk_prob` (Qwen MoE
    convention): the softmax after the top-k renormalises the chosen experts' weights, the one before
    does not. Configs without `norm_topk_prob` are left as the bridge set them."""
    norm = getattr(hf_config, "norm_topk_prob", None)
    if norm is not None and getattr(provider, "num_moe_experts", None):
        provider.moe_router_pre_softmax = not bool(norm)


_LAYER_KINDS = {"linear_attention": 1, "full_attention": 0}  # megatron's pattern: 1 = Gated DeltaNet


def exact_attention_pattern(provider, hf_config) -> None:
    """Set `provider.linear_attention_freq` to the per-layer pattern of the HF config's `layer_types`
    (the text config's, for a ConditionalGeneration config), as Megatron-Bridge 0.6 does; 0.5.x sets
    an interval, which is right only where the layer kinds are periodic. No `layer_types`: unchanged."""
    text_config = getattr(hf_config, "text_config", None) or hf_config
    layer_types = getattr(text_config, "layer_types", None)
    if not isinstance(layer_types, (list, tuple)) or not layer_types:
        return
    unknown = sorted(set(layer_types) - set(_LAYER_KINDS))
    if unknown:
        raise ValueError(
            f"the checkpoint's config.json `layer_types` has {unknown}: Qwen3.5 layers are "
            f"{sorted(_LAYER_KINDS)}. Fix: a Qwen3.5 checkpoint, or another `PS_BRIDGE_PROVIDER`."
        )
    provider.linear_attention_freq = [_LAYER_KINDS[kind] for kind in layer_types]


def dispatch_sources(source) -> List[object]:
    """The keys to register a bridge for HF architecture `source` (class or class name) under:
    the class name, and the transformers class where transformers has one."""
    # imported here: transformers is heavy
    import transformers

    name = source if isinstance(source, str) else source.__name__
    keys: List[object] = [name]
    cls = source if not isinstance(source, str) else getattr(transformers, name, None)
    if isinstance(cls, type):
        keys.append(cls)
    return keys


_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight$")


def _checkpoint_keys(hf_pretrained) -> Optional[List[str]]:
    source = getattr(getattr(hf_pretrained, "state", None), "source", None)
    if source is None or not hasattr(source, "get_all_keys"):
        return None
    return list(source.get_all_keys())


def experts_as_stored(registry, hf_pretrained):
    """The Qwen3.5 MoE mapping `registry` with its routed experts mapped the way the checkpoint stores
    them. Megatron-Bridge 0.6 picks fused (`experts.gate_up_proj`) or per-expert
    (`experts.<i>.gate_proj.weight`, what `save_pretrained` writes) from the checkpoint's keys itself;
    0.5.x maps the decoder's experts as fused only, so where the checkpoint is per-expert the fused
    mappings are replaced by per-expert ones (Megatron-Bridge's own `GatedMLPMapping` / `AutoMapping`,
    as its 0.5 bridge maps per-expert MTP layers)."""
    # imported here: Megatron-Bridge is heavy
    from megatron.bridge.models.conversion import utils as mb_utils

    if hasattr(mb_utils, "moe_experts_stored_packed"):  # 0.6+: the stock bridge follows the checkpoint
        return registry
    keys = _checkpoint_keys(hf_pretrained)
    if not keys or not any(_PER_EXPERT.search(k) for k in keys):
        return registry
    # imported here: Megatron-Bridge is heavy
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import (
        AutoMapping,
        FusedExpertMapping,
        FusedGatedExpertMapping,
        GatedMLPMapping,
    )

    mappings = []
    for m in registry.mappings:
        hf = getattr(m, "hf_param", None)
        if type(m) is FusedGatedExpertMapping and hf.endswith(".experts.gate_up_proj"):
            experts = hf[: -len("gate_up_proj")]
            m = GatedMLPMapping(
                megatron_param=m.megatron_param, gate=f"{experts}*.gate_proj.weight", up=f"{experts}*.up_proj.weight"
            )
        elif type(m) is FusedExpertMapping and hf.endswith(".experts.down_proj"):
            m = AutoMapping(megatron_param=m.megatron_param, hf_param=f"{hf[: -len('down_proj')]}*.down_proj.weight")
        mappings.append(m)
    return MegatronMappingRegistry(*mappings)


def exact_gelu_merger(model) -> None:
    """The patch merger of a built Qwen3.5 `Qwen3VLModel`'s vision tower with exact GELU, as
    transformers' (see the module docstring); a model without a vision tower is left as it is."""
    # imported here: torch is heavy; this module otherwise needs only package metadata
    import torch.nn.functional as F

    vision = getattr(model, "vision_model", None)
    merger = getattr(vision, "merger", None)
    if merger is not None:
        merger.activation_func = F.gelu
