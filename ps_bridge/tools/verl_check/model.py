"""The checkpoint verl-check runs (given, or a random one of a catalogue shape) and which engine
stands for "stock" on it."""

from __future__ import annotations

from functools import lru_cache

import gc
import os

import torch

from ps_bridge.compat.stock_attention import stock_attention_name
from ps_bridge.tools.bench.catalog import MODEL_SHAPES, is_vision_language, shape_hf_config
from ps_bridge.tools.verl_check.config import CheckSettings
from ps_bridge.tools.verl_check.side_by_side import save_tiny_tokenizer


def checkpoint_for(settings: CheckSettings, workdir: str) -> str:
    """`settings.model` as an HF checkpoint directory with a tokenizer: as given, or a random one of
    a catalogue shape (written once into `workdir`)."""
    if os.path.isdir(settings.model):
        return settings.model
    if settings.model not in MODEL_SHAPES:
        raise ValueError(f"--model {settings.model!r} is neither a checkpoint directory nor a catalogue shape "
                         f"({', '.join(sorted(MODEL_SHAPES))})")
    shape = MODEL_SHAPES[settings.model]
    layers = settings.layers or shape.bench_layers
    path = os.path.join(workdir, f"{settings.model}-{layers}l-seed{settings.seed}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    # imported here: transformers is heavy
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    hf_config = shape_hf_config(shape, layers)  # a vision-language shape: its tower cut in proportion
    torch.manual_seed(settings.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if settings.dtype == "float32" else torch.bfloat16
    auto = AutoModelForImageTextToText if is_vision_language(shape) else AutoModelForCausalLM
    with torch.device(device):
        model = auto.from_config(hf_config, dtype=dtype)
    model.save_pretrained(path)
    del model
    free_memory()
    save_tiny_tokenizer(path, hf_config.get_text_config().vocab_size)
    return path


# dense families whose stock Megatron-Bridge model verl's engine runs here with the local layer spec
# (no Transformer Engine): Qwen2 / Qwen2.5, Qwen3 (its q/k norms are megatron's local per-head norms)
STOCK_ENGINE_ARCHITECTURES = {"Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def stock_kind(ckpt: str, baseline: str = "stock") -> str:
    """The first engine: 'verl' when `baseline` is "stock" and verl's stock engine can run this family
    here, else 'ps-bridge-unshared' (our engine with prefix sharing off: `baseline="off"`:
    "sharing on vs sharing off" with the same model code on both sides)."""
    # imported here: transformers is heavy
    from transformers import AutoConfig

    if baseline not in ("stock", "off"):
        raise ValueError(f"verl-check --baseline must be 'stock' or 'off', got {baseline!r}")
    if baseline == "off":
        return "ps-bridge-unshared"

    archs = AutoConfig.from_pretrained(ckpt).architectures or []
    return "verl" if set(archs) & STOCK_ENGINE_ARCHITECTURES else "ps-bridge-unshared"


def stock_description(ckpt: str, settings: CheckSettings) -> str:
    if stock_kind(ckpt, settings.baseline) == "verl":
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(settings.dtype, torch.float32)
        return f"verl MegatronEngineWithLMHead, Megatron-Bridge stock provider, core attention: {stock_attention_name(dtype)}"
    if settings.baseline == "off":
        return "ps-bridge engine with prefix sharing off (one sequence per sample; --baseline off)"
    return ("ps-bridge engine with sharing off (one sequence per sample; verl's stock model of this family "
            "needs Transformer Engine)")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@lru_cache(maxsize=None)
def checkpoint_config(ckpt: str):
    """The checkpoint's HF config, read once per checkpoint (a vision-language model's: its tower and
    image ids for `--images`, the FLOP shape of F with the tower)."""
    # imported here: transformers is heavy
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ckpt)


def checkpoint_text_config(ckpt: str):
    """The checkpoint's HF text config (the vocabulary of the synthetic data)."""
    return checkpoint_config(ckpt).get_text_config()

