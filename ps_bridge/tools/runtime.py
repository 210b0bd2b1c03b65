"""Build a prefix-aware Megatron model from a Hugging Face checkpoint and run packed batches.

This is the path the CLI, the demo and the tests share: HF checkpoint -> our Megatron-Bridge bridge
-> our provider -> `PrefixSharedGPTModel` with HF weights -> packed layout -> logits -> log-probs.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ps_bridge.compat.quiet import third_party_prints
from ps_bridge.compat.te_placeholder import import_megatron_bridge
from ps_bridge.config import PrefixSharingConfig
from ps_bridge.cuda_graphs import buckets_for
from ps_bridge.forward import local_shard, run_packed
from ps_bridge.launch_rule import ModelCost
from ps_bridge.layout import PackedPrefixLayout
from ps_bridge.parallel.gradients import broadcast_replicas
from ps_bridge.parallel.groups import init_parallel
from ps_bridge.parallel.settings import ParallelSettings, configure_provider, padded_vocab_size
from ps_bridge.plan import SharingPlan
from ps_bridge.prepare import micro_batch_layout
from ps_bridge.providers.registry import register_all, resolve_provider
from ps_bridge.rows import PackedRows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def read_hf_config(hf_path: str) -> dict:
    """The checkpoint's config.json, with errors that say what is wrong with the path."""
    cfg = Path(hf_path) / "config.json"
    if not Path(hf_path).is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {hf_path}")
    if not cfg.is_file():
        raise FileNotFoundError(f"no config.json in {hf_path}: not a Hugging Face checkpoint directory")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg} is not valid JSON: {e}") from None
    return data


@dataclass
class LoadedModel:
    model: torch.nn.Module  # the Megatron module (unwrapped)
    bridge: object  # megatron.bridge AutoBridge
    provider: object
    provider_name: str
    vocab_size: int  # the checkpoint's vocabulary (log-probs are over these ids)
    config: PrefixSharingConfig
    device: torch.device
    dtype: torch.dtype
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    cp: int = 1  # context-parallel size: each CP rank runs one contiguous shard of the pack
    ep: int = 1  # expert-parallel size (MoE): its ranks are data-parallel ranks, each with its own samples
    # the vocabulary megatron's embedding and output layer have: `vocab_size` padded up when TP
    # does not divide it (the logits of the padded ids are kept out of the log-probs)
    padded_vocab_size: Optional[int] = None
    # what the sharing rule (`ps_bridge.launch_rule`) needs of the model, from its HF config
    model_cost: Optional[ModelCost] = None


def load_model(
    hf_path: str,
    config: Optional[PrefixSharingConfig] = None,
    dtype: torch.dtype = torch.float32,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    ep: int = 1,
) -> LoadedModel:
    """Convert `hf_path` through our provider and load this rank's shard of its weights.

    The parallel settings are set on the provider before the model is built, so megatron builds
    this rank's TP shard and PP stage and Megatron-Bridge loads the matching slices.
    """
    config = config or PrefixSharingConfig()
    settings = _settings(tp, pp, sequence_parallel, cp, ep)
    hf_dict = read_hf_config(hf_path)
    entry = _prepare_bridge(config, hf_dict, settings)
    # imported here: megatron-core is heavy
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf_path, torch_dtype=dtype)
    loaded = _provide_model(bridge, entry.name, config, dtype, settings, load_weights=True)
    loaded.model_cost = ModelCost.try_from_hf_config(hf_dict)
    return loaded


def load_model_from_hf_config(
    hf_config,
    config: Optional[PrefixSharingConfig] = None,
    dtype: torch.dtype = torch.float32,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    ep: int = 1,
) -> LoadedModel:
    """Like `load_model`, from a transformers config object: same bridge and provider, random
    weights (megatron's own initialisation, on the GPU when there is one). For benchmarks."""
    config = config or PrefixSharingConfig()
    settings = _settings(tp, pp, sequence_parallel, cp, ep)
    hf_dict = hf_config.to_dict()
    entry = _prepare_bridge(config, hf_dict, settings)
    # imported here: megatron-core is heavy
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_config(hf_config)
    loaded = _provide_model(bridge, entry.name, config, dtype, settings, load_weights=False)
    loaded.model_cost = ModelCost.try_from_hf_config(hf_dict)
    return loaded


def _settings(tp: int, pp: int, sequence_parallel: bool, cp: int, ep: int = 1):
    return ParallelSettings(tp=tp, pp=pp, cp=cp, sequence_parallel=sequence_parallel, ep=ep)


def _prepare_bridge(config: PrefixSharingConfig, hf_config: dict, settings):
    """Check the parallel settings (against the checkpoint's config.json dict too), pick our
    provider for its architectures, import Megatron-Bridge with our bridges registered, and set up
    the parallel groups; returns the provider entry."""
    # before any process group: every rank refuses alike
    settings.check(hf_config=hf_config)
    entry = resolve_provider(config.provider, list(hf_config.get("architectures") or []))
    import_megatron_bridge()
    register_all(config)
    init_parallel(tp=settings.tp, pp=settings.pp, cp=settings.cp, ep=settings.ep)
    return entry


def _provide_model(bridge, provider_name, config, dtype, settings, load_weights) -> LoadedModel:
    tp, pp = settings.tp, settings.pp
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    # TP / PP / SP / CP / EP, plus the vocabulary padding and uneven pipeline stages the shapes may need
    configure_provider(provider, settings)
    provider.pipeline_dtype = dtype
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
    if pp > 1:
        # Every micro-batch packs to its own length, so pipeline stages exchange shapes before
        # activations. Set after finalize(): its validation rejects the flag for MoE's allgather
        # dispatcher even in dense models, and only the pipeline schedule reads it.
        provider.variable_seq_lengths = True

    with third_party_prints():  # megatron's parameter count, the bridge's loading progress
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
    if not load_weights:  # random weights: the CP / data-parallel replicas must be one model

        broadcast_replicas(model)
    return LoadedModel(
        model=model,
        bridge=bridge,
        provider=provider,
        provider_name=provider_name,
        vocab_size=int(provider.vocab_size),
        config=config,
        device=device,
        dtype=dtype,
        tp=tp,
        pp=pp,
        sequence_parallel=settings.sequence_parallel,
        cp=settings.cp,
        ep=settings.ep,
        padded_vocab_size=padded_vocab_size(provider),
    )


@contextlib.contextmanager
def tf32_disabled():
    """float32 matmuls and convolutions in true float32 (no TF32) inside the block; the previous
    settings come back after it. For float32 reference runs on a GPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def float32_reference_model(loaded: LoadedModel, hf_config) -> LoadedModel:
    """A float32 twin of a (bf16) model with exactly its weights (bf16 values upcast exactly) and the
    `torch_ref` attention and Gated DeltaNet kernels: the computation a bf16 run approximates.
    TP = PP = 1, the model's CP and EP sizes (CP ranks hold whole replicas, EP ranks their experts);
    run it under `tf32_disabled()` to make it a true float32 reference."""
    if loaded.tp > 1 or loaded.pp > 1:
        raise ValueError("float32_reference_model builds a twin without TP / PP; got tp/pp > 1")
    config = PrefixSharingConfig(enabled=False, backend="torch_ref", gdn_backend="torch_ref", pad_multiple=1)
    twin = load_model_from_hf_config(hf_config, config, dtype=torch.float32, cp=loaded.cp, ep=loaded.ep)  # same shards
    target = twin.model.state_dict()
    twin.model.load_state_dict({
        name: value.to(target[name].dtype) if torch.is_tensor(value) and value.is_floating_point() else value
        for name, value in loaded.model.state_dict().items()
    })
    return twin

def make_layout(samples, loaded: LoadedModel, share: Optional[bool] = None) -> PackedPrefixLayout:
    """The packed layout of `samples` for this model: segments padded to the TP size (sequence
    parallelism scatters the pack evenly), the whole pack to `cp_total_multiple()` under CP; a shared
    layout lists the read positions unless `loaded.config.prompt_values` (`PrefixSharingConfig`).
    `share=None`: the sharing rule decides (`launch_rule.sharing_for`, as the verl engine);
    True / False: that packing. A shared packing is a prefix tree where `loaded.config.tree`; the
    tree is decided once (`plan.SharingPlan`), the rule reading its token count and the layout packing
    it (`prepare.micro_batch_layout`, the step the verl engine runs too)."""
    pad = loaded.config.pad_multiple or int(getattr(loaded.provider, "tensor_model_parallel_size", 1))
    layout, _ = micro_batch_layout(samples, loaded.config, loaded.model_cost, loaded.device.type, loaded.dtype,
                                   plan=SharingPlan.from_config(loaded.config, pad, buckets_for(loaded.model, loaded.config)),
                                   vocab_size=loaded.vocab_size,
                                   share=share)
    return layout


def forward_logits(loaded: LoadedModel, layout: PackedPrefixLayout) -> torch.Tensor:
    """Packed logits `[T, V / tp]` (of this rank's `T / cp` shard under CP) for a layout on a single pipeline stage: the full vocabulary at
    TP=1, this rank's vocabulary shard at TP>1 (megatron's parallel output layer); `V` is
    `loaded.padded_vocab_size` (the layout's rows mask the padded ids: `make_layout`)."""
    if loaded.pp > 1:
        raise ValueError(
            f"forward_logits runs one pipeline stage; with pipeline_model_parallel_size={loaded.pp} "
            "use ps_bridge.tools.schedule.logprob_pass, which runs megatron's pipeline schedule"
        )
    logits = run_packed(loaded.model, layout.to(loaded.device), loaded.config)
    return logits.reshape(-1, logits.shape[-1])


def row_logprobs(loaded: LoadedModel, layout: PackedPrefixLayout, chunk_rows: int = 1024) -> torch.Tensor:
    """Flattened per-sample rows of log-probs, single pipeline stage. Every TP and CP rank gets the
    full rows; under CP their gradient flows to this rank's own rows only (`PackedRows.complete`:
    megatron's CP gradient reduction completes it)."""
    layout = layout.to(loaded.device)
    rows = PackedRows.of(layout, cp_shard=local_shard(layout))
    logits = forward_logits(loaded, layout)
    return rows.complete(rows.logprobs(logits, vocab_parallel=loaded.tp > 1, chunk_rows=chunk_rows))
