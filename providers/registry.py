"""Provider registry: our prefix-aware providers by name.

A name is chosen explicitly (`PrefixSharingConfig.provider`, `PS_BRIDGE_PROVIDER`, `--provider`)
or detected from the Hugging Face config's `architectures`. Registering makes Megatron-Bridge's
`AutoBridge` dispatch those architectures to our bridges (the registry's last registration wins).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class ProviderEntry:
    name: str
    module: str  # ps_bridge.providers.<family>; has HF_ARCHITECTURES and register()
    hf_architectures: Tuple[str, ...]
    description: str

    def load(self):
        from ps_bridge.compat.te_placeholder import import_megatron_bridge

        import_megatron_bridge()
        return importlib.import_module(self.module)


_ENTRIES: Dict[str, ProviderEntry] = {}


def add_provider(entry: ProviderEntry) -> None:
    _ENTRIES[entry.name] = entry


add_provider(
    ProviderEntry(
        name="qwen2.5",
        module="ps_bridge.providers.qwen2",
        hf_architectures=("Qwen2ForCausalLM",),
        description="Qwen2 / Qwen2.5 dense causal LM",
    )
)
add_provider(
    ProviderEntry(
        name="qwen3.5",
        module="ps_bridge.providers.qwen35",
        hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
        description="Qwen3.5 dense (Gated DeltaNet + gated attention), text and official VL checkpoints",
    )
)
add_provider(
    ProviderEntry(
        name="qwen3.5-moe",
        module="ps_bridge.providers.qwen35",
        hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        description="Qwen3.5 MoE (Gated DeltaNet + gated attention), text and official VL checkpoints",
    )
)


def provider_names() -> List[str]:
    return sorted(_ENTRIES)


def get_provider_entry(name: str) -> ProviderEntry:
    try:
        return _ENTRIES[name]
    except KeyError:
        raise ValueError(f"unknown ps-bridge provider {name!r}; valid providers: {', '.join(provider_names())}") from None


def supported_architectures() -> List[str]:
    return sorted({a for e in _ENTRIES.values() for a in e.hf_architectures})


def resolve_provider(name: Optional[str], hf_architectures: Sequence[str]) -> ProviderEntry:
    """The entry named `name`, or the one serving the checkpoint's architectures."""
    if name is not None:
        entry = get_provider_entry(name)
        if hf_architectures and not set(hf_architectures) & set(entry.hf_architectures):
            raise ValueError(
                f"provider {name!r} serves {', '.join(entry.hf_architectures)}, "
                f"but the checkpoint declares {', '.join(hf_architectures)}"
            )
        return entry
    for entry in _ENTRIES.values():
        if set(hf_architectures) & set(entry.hf_architectures):
            return entry
    raise ValueError(
        f"unsupported architecture {', '.join(hf_architectures) or '(none declared)'}; "
        f"ps-bridge supports: {', '.join(supported_architectures())}"
    )


def register_all() -> None:
    """Register every provider's bridge with Megatron-Bridge (idempotent)."""
    for entry in _ENTRIES.values():
        entry.load().register()
