"""verl's stock Megatron engine and ours, side by side in one process, on the same weights.

What a comparison of the two engines needs (the tests, and `ps-bridge verl-check`):
- `build_engine`: verl's own constructor and `initialize()` for an engine class;
- `build_stock_engine`: verl's stock `MegatronEngineWithLMHead` on Megatron-Bridge's stock provider,
  built while our bridges are registered (`stock_bridges()` restores the stock dispatch around it);
- `ReferenceCoreAttention`: plain causal softmax attention in both of verl's input formats for the
  *stock* model where Transformer Engine is absent (megatron's local core attention refuses them);
- `tiny_checkpoint`, `grpo_micro_batch`: a checkpoint with a tokenizer, and a batch built the way
  verl's trainer builds it.
On a CPU, call `ps_bridge.compat.verl_on_cpu.prepare_cpu_process()` first, then `prepare_side_by_side()`.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch

from ps_bridge.compat import verl as verl_compat
from ps_bridge.compat.stock_attention import reference_gpt_layer_spec
from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu, prepare_cpu_process
from ps_bridge.config import PrefixSharingConfig
from ps_bridge.parallel.groups import init_parallel
from ps_bridge.providers.base import FUSIONS_OFF
from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

# ---- model, tokenizer, engine --------------------------------------------------------------


def save_tiny_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` ids; verl reads `pad_token_id` from it."""
    # imported here: tokenizers comes with transformers (heavy); transformers is heavy
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1", bos_token="t2")
    fast.save_pretrained(path)


def tiny_checkpoint(path: str, family: str = "qwen2.5", seed: int = 0, **overrides):
    """A tiny random HF checkpoint of `family` (ps_bridge.tools.tiny_checkpoints.TINY_BUILDERS, with its
    config `overrides`) plus a tokenizer."""
    hf_model = TINY_BUILDERS[family](path, seed=seed, **overrides)
    save_tiny_tokenizer(path, hf_model.config.get_text_config().vocab_size)
    return hf_model


def stock_overrides() -> dict:
    """The stock engine's config overrides: our providers' fusions off (`FUSIONS_OFF`), no dropout,
    so both engines of a comparison compute the same thing."""
    return dict(FUSIONS_OFF, attention_dropout=0.0, hidden_dropout=0.0, attention_backend="auto")


def plain_adam(**overrides):
    """The tests' optimizer config: Adam at lr 1e-3, no gradient clipping, no weight decay; `overrides`:
    fields of megatron's OptimizerConfig (verl's `override_optimizer_config`)."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.workers.config import McoreOptimizerConfig

    extra = {"override_optimizer_config": dict(overrides)} if overrides else {}
    return McoreOptimizerConfig(lr=1e-3, clip_grad=0.0, weight_decay=0.0, total_training_steps=10,
                                lr_warmup_steps=0, **extra)


def build_engine(engine_cls, ckpt: str, *, use_remove_padding: bool = True, forward_only: bool = True,
                 overrides: Optional[dict] = None, use_fused_kernels: bool = False,
                 external_lib: Optional[str] = None, vanilla_mbridge: bool = False, tp: int = 1,
                 sequence_parallel: bool = False, engine_config=None, optimizer_config=None,
                 dtype: str = "float32", cp: int = 1, ep: int = 1, pp: int = 1):
    """verl's own constructor and `initialize()` for `engine_cls`, on the CPU (one process per
    tensor / pipeline / context / expert-parallel rank under torchrun, gloo) or the GPU. `engine_config` / `optimizer_config`: verl's
    `McoreEngineConfig` / `McoreOptimizerConfig` from a trainer config (`ps-bridge verl-check`), else
    the tests' (fp32, TP `tp`, PP `pp`, CP `cp`, EP `ep`, plain Adam). Either way the fusions and dropout are off
    (`stock_overrides`): both engines of a comparison compute the same thing."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig

    model_config = HFModelConfig(path=ckpt, use_remove_padding=use_remove_padding, external_lib=external_lib)
    if engine_config is None:
        engine_config = McoreEngineConfig(
            forward_only=forward_only,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            sequence_parallel=sequence_parallel,
            use_distributed_optimizer=False,
            vanilla_mbridge=vanilla_mbridge,
            override_transformer_config=dict(stock_overrides(), **(overrides or {})),
        )
    else:
        user = dict(engine_config.override_transformer_config or {})
        object.__setattr__(engine_config, "override_transformer_config", dict(user, **stock_overrides(), **(overrides or {})))
        object.__setattr__(engine_config, "forward_only", forward_only)
        tp = engine_config.tensor_model_parallel_size
        pp = engine_config.pipeline_model_parallel_size
        cp = engine_config.context_parallel_size
        ep = engine_config.expert_model_parallel_size
    init_parallel(tp=tp, pp=pp, cp=cp, ep=ep)
    # McoreEngineConfig accepts only bf16/fp16 at construction; fp32 makes the comparison exact.
    object.__setattr__(engine_config, "dtype", dtype)
    object.__setattr__(engine_config, "use_remove_padding", use_remove_padding)
    object.__setattr__(engine_config, "use_fused_kernels", use_fused_kernels)
    if optimizer_config is None:
        optimizer_config = plain_adam()
    fp32 = verl_compat.fp32_optimizer_overrides(dtype)
    if fp32 and hasattr(optimizer_config, "override_optimizer_config"):  # (a ref's config has none: no optimizer)
        object.__setattr__(optimizer_config, "override_optimizer_config",
                           dict(optimizer_config.override_optimizer_config or {}, **fp32))
    engine = engine_cls(model_config, engine_config, optimizer_config, CheckpointConfig())
    with engine_call_on_cpu():  # megatron's optimizer keeps scalars on device="cuda"
        engine.initialize()
    return engine


# ---- a batch built like verl's trainer --------------------------------------------------------


def grpo_micro_batch(samples, *, micro_batch_size: Optional[int] = None, max_token_len: Optional[int] = None,
                     temperature: float = 1.0, advantages_seed: int = 0):
    """`samples` (ps_bridge.layout.Sample, n adjacent responses per prompt) as the TensorDict that
    `RayPPOTrainer._compute_old_log_prob` hands the worker: left-padded prompts, right-padded
    responses, uid, then `left_right_2_no_padding`, plus the worker's micro-batching keys."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.protocol import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    B = len(samples)
    Pmax = max(len(s.prompt) for s in samples)
    Rmax = max(len(s.response) for s in samples)
    prompts = torch.zeros(B, Pmax, dtype=torch.long)
    responses = torch.zeros(B, Rmax, dtype=torch.long)
    attention_mask = torch.zeros(B, Pmax + Rmax, dtype=torch.long)
    for i, s in enumerate(samples):
        P, R = len(s.prompt), len(s.response)
        prompts[i, Pmax - P:] = torch.tensor(s.prompt)
        responses[i, :R] = torch.tensor(s.response)
        attention_mask[i, Pmax - P: Pmax + R] = 1
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, Pmax:].clone()
    gen = torch.Generator().manual_seed(advantages_seed)
    batch = {
        "prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": position_ids, "response_mask": response_mask,
        "advantages": torch.randn(B, Rmax, generator=gen) * response_mask,
        "old_log_probs": -torch.rand(B, Rmax, generator=gen) * response_mask,
    }
    uid = np.array([s.uid for s in samples], dtype=object)
    data = DataProto.from_dict(tensors=batch, non_tensors={"uid": uid})
    td = left_right_2_no_padding(data.to_tensordict())
    td["temperature"] = torch.full((B,), float(temperature))
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, use_remove_padding=True,
                         use_fused_kernels=False, global_batch_size=B)
    if max_token_len is not None:
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=max_token_len)
    else:
        tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch_size or B)
    return td


# ---- the stock bridges, while ours are registered -----------------------------------------------

_STOCK_DISPATCH: dict = {}


def _bridge_dispatchers():
    # imported here: megatron-core is heavy
    from megatron.bridge.models.conversion import model_bridge
    from megatron.bridge.models.decorators.dispatch import _Dispatch

    return {name: obj for name, obj in vars(model_bridge).items() if isinstance(obj, _Dispatch)}


def remember_stock_bridges() -> None:
    """Snapshot Megatron-Bridge's dispatch tables; call before `register_all()`."""
    if not _STOCK_DISPATCH:
        for name, d in _bridge_dispatchers().items():
            _STOCK_DISPATCH[name] = dict(d._exact_types)


@contextlib.contextmanager
def stock_bridges():
    """Megatron-Bridge dispatches to its stock bridges inside this context (to build the stock
    engine's model in the same process), and to whatever was registered before, after it."""
    saved = {}
    for name, d in _bridge_dispatchers().items():
        saved[name] = dict(d._exact_types)
        d._exact_types.clear()
        d._exact_types.update(_STOCK_DISPATCH.get(name, saved[name]))
        d._dispatch_cache.clear()
    try:
        yield
    finally:
        for name, d in _bridge_dispatchers().items():
            d._exact_types.clear()
            d._exact_types.update(saved[name])
            d._dispatch_cache.clear()


def prepare_side_by_side() -> None:
    """CPU preparation, the stock bridges remembered, then the plugin activated (sharing on)."""
    prepare_cpu_process()
    remember_stock_bridges()
    # imported here: after the stock bridges are remembered (the plugin's import registers ours where sharing is on)
    import ps_bridge.verl as plugin

    plugin.activate(PrefixSharingConfig(enabled=True))


def build_stock_engine(ckpt: str, **kwargs):
    """verl's stock `MegatronEngineWithLMHead` on Megatron-Bridge's stock provider, with the
    reference core attention (the only non-stock module, needed because none runs on a CPU)."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    overrides = dict(kwargs.pop("overrides", None) or {}, transformer_layer_spec=reference_gpt_layer_spec)
    with stock_bridges():
        return build_engine(MegatronEngineWithLMHead, ckpt, overrides=overrides, **kwargs)
