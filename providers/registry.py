"""Provider registry: our prefix-aware providers by name.

A name is chosen explicitly (`PrefixSharingConfig.provider`, `PS_BRIDGE_PROVIDER`, `--provider`)
or detected from the Hugging Face config's `architectures`. Each family module
(`ps_bridge.providers.<family>`) holds a registration table (`REGISTRATIONS`), the only list of the
HF architectures it serves; this registry knows the families and their names. Registering makes
Megatron-Bridge's `AutoBridge` dispatch those architectures to our bridges (the registry's last
registration wins).

Standard-attention GPT families (plain `GPTModel`, softmax self-attention, dense or MoE MLP) need no
module of their own: one row of `STANDARD_FAMILIES` (name, HF architecture, HF model_type, the stock
Megatron-Bridge bridge) is the whole registration (`ps_bridge.providers.gpt`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ps_bridge.compat.te_placeholder import import_megatron_bridge


@dataclass(frozen=True)
class ProviderEntry:
    name: str
    module: str  # ps_bridge.providers.<family>: REGISTRATIONS and register()
    description: str

    def load(self):
        import_megatron_bridge()
        return importlib.import_module(self.module)

    @property
    def hf_architectures(self) -> Tuple[str, ...]:
        return tuple(row.hf_architecture for row in self.load().REGISTRATIONS if row.name == self.name)


@dataclass(frozen=True)
class StandardFamily:
    name: str  # our registry name
    hf_architecture: str  # the HF `architectures` entry
    model_type: str  # HF model_type
    stock_bridge: str  # "module:Class" of Megatron-Bridge's bridge (mapping and config translation)
    description: str


# adding a standard-attention family is one row here, plus its tests
STANDARD_FAMILIES: Tuple[StandardFamily, ...] = (
    StandardFamily("qwen3", "Qwen3ForCausalLM", "qwen3", "megatron.bridge.models.qwen.qwen3_bridge:Qwen3Bridge",
                   "Qwen3 dense (q/k norm per head, no q/k/v bias)"),
    StandardFamily("qwen3-moe", "Qwen3MoeForCausalLM", "qwen3_moe",
                   "megatron.bridge.models.qwen.qwen3_moe_bridge:Qwen3MoEBridge",
                   "Qwen3 MoE (routed experts, no shared expert; dense layers from mlp_only_layers)"),
    StandardFamily("llama3", "LlamaForCausalLM", "llama", "megatron.bridge.models.llama.llama_bridge:LlamaBridge",
                   "Llama 3 / 3.1 / 3.2 / 3.3 (RoPE scaling llama3)"),
)

_ENTRIES: Dict[str, ProviderEntry] = {
    entry.name: entry
    for entry in (
        ProviderEntry("qwen2.5", "ps_bridge.providers.qwen2", "Qwen2 / Qwen2.5 dense causal LM"),
        ProviderEntry(
            "qwen3.5", "ps_bridge.providers.qwen35",
            "Qwen3.5 dense (Gated DeltaNet + gated attention), text and official VL checkpoints",
        ),
        ProviderEntry(
            "qwen3.5-moe", "ps_bridge.providers.qwen35",
            "Qwen3.5 MoE (Gated DeltaNet + gated attention), text and official VL checkpoints",
        ),
        *(ProviderEntry(f.name, "ps_bridge.providers.gpt", f.description) for f in STANDARD_FAMILIES),
    )
}


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


def register_all(config=None) -> None:
    """Register every family's bridges with Megatron-Bridge (idempotent). `config` (the run's
    `PrefixSharingConfig`) gives the bridges what they set on the providers they build: the Gated
    DeltaNet backend (`auto` when no config is given)."""
    gdn_backend = getattr(config, "gdn_backend", None) or "auto"
    import_megatron_bridge()
    for module in sorted({e.module for e in _ENTRIES.values()}):
        importlib.import_module(module).register(gdn_backend=gdn_backend)
