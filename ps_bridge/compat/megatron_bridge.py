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
"""

from __future__ import annotations

import importlib.metadata
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
    # imported here: megatron-core is heavy
    from megatron.bridge.models.conversion import utils as mb_utils

    if hasattr(mb_utils, "moe_experts_stored_packed"):  # 0.6+: the stock bridge follows the checkpoint
        return registry
    keys = _checkpoint_keys(hf_pretrained)
    if not keys or not any(_PER_EXPERT.search(k) for k in keys):
        return registry
    # imported here: megatron-core is heavy
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
