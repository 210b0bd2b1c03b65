"""Build a prefix-aware Megatron model from a Hugging Face checkpoint and run packed batches.

This is the path the CLI, the demo and the tests share: HF checkpoint -> our Megatron-Bridge bridge
-> our provider -> `PrefixSharedGPTModel` with HF weights -> packed layout -> logits -> log-probs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.layout import PackedPrefixLayout, Sample, build_layout, log_layout
from ps_bridge.logprobs import packed_row_logprobs
from ps_bridge.parallel_info import rank_tag

logger = logging.getLogger("ps_bridge")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_parallel(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU; world size 1 when not launched by torchrun) and
    megatron's model-parallel groups, seeded; idempotent."""
    import torch.distributed as dist

    from ps_bridge.compat import cuda_on_cpu

    cuda_on_cpu.enable()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def read_hf_architectures(hf_path: str) -> List[str]:
    cfg = Path(hf_path) / "config.json"
    if not Path(hf_path).is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {hf_path}")
    if not cfg.is_file():
        raise FileNotFoundError(f"no config.json in {hf_path}: not a Hugging Face checkpoint directory")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg} is not valid JSON: {e}") from None
    return list(data.get("architectures") or [])


@dataclass
class LoadedModel:
    model: torch.nn.Module  # the Megatron module (unwrapped)
    bridge: object  # megatron.bridge AutoBridge
    provider: object
    provider_name: str
    vocab_size: int
    config: PrefixSharingConfig
    device: torch.device
    dtype: torch.dtype


def load_model(
    hf_path: str,
    config: Optional[PrefixSharingConfig] = None,
    dtype: torch.dtype = torch.float32,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
) -> LoadedModel:
    """Convert `hf_path` through our provider and load its weights (single pipeline stage)."""
    from ps_bridge.compat.te_placeholder import import_megatron_bridge
    from ps_bridge.providers.registry import register_all, resolve_provider

    config = config or PrefixSharingConfig()
    archs = read_hf_architectures(hf_path)
    entry = resolve_provider(config.provider, archs)
    import_megatron_bridge()
    register_all()
    init_parallel(tp=tp, pp=pp)
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf_path, torch_dtype=dtype)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.sequence_parallel = sequence_parallel
    provider.params_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = False
    provider.autocast_dtype = dtype
    provider.attention_dropout = 0.0
    provider.hidden_dropout = 0.0
    provider.use_cpu_initialization = not torch.cuda.is_available()
    if hasattr(provider, "gdn_backend"):  # Qwen3.5 providers: the Gated DeltaNet kernels to use
        provider.gdn_backend = config.gdn_backend
    provider.finalize()
    models = provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        mixed_precision_wrapper=None,
        bf16=dtype == torch.bfloat16,
        fp16=False,
    )
    model = models[0]
    device = default_device()
    model.to(device=device, dtype=dtype)
    return LoadedModel(
        model=model,
        bridge=bridge,
        provider=provider,
        provider_name=entry.name,
        vocab_size=int(provider.vocab_size),
        config=config,
        device=device,
        dtype=dtype,
    )


def make_layout(samples, loaded: LoadedModel, share: Optional[bool] = None) -> PackedPrefixLayout:
    share = loaded.config.enabled if share is None else share
    pad = loaded.config.pad_multiple or int(getattr(loaded.provider, "tensor_model_parallel_size", 1))
    layout = build_layout(samples, share=share, pad_multiple=pad, vocab_size=loaded.vocab_size)
    log_layout(layout, f"[{rank_tag()}]")
    return layout


def forward_logits(loaded: LoadedModel, layout: PackedPrefixLayout) -> torch.Tensor:
    """Packed logits `[T, V]` for a layout (full vocabulary; TP=1)."""
    from ps_bridge.models.packed_seq import PrefixSharedPackedSeqParams

    layout = layout.to(loaded.device)
    params = PrefixSharedPackedSeqParams.from_layout(layout, backend=loaded.config.backend)
    logits = loaded.model(
        input_ids=layout.tokens.unsqueeze(0),
        position_ids=layout.positions.unsqueeze(0),
        attention_mask=None,
        packed_seq_params=params,
    )
    return logits.reshape(-1, logits.shape[-1])


def row_logprobs(loaded: LoadedModel, layout: PackedPrefixLayout) -> torch.Tensor:
    return packed_row_logprobs(forward_logits(loaded, layout), layout.to(loaded.device))
