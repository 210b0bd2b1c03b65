"""Run verl 0.9.1's real Megatron engines on a CPU, for the tests (DESIGN.md section 8).

Kept outside the `ps_bridge.verl` package on purpose: importing that package activates the plugin,
which needs verl importable, and on a CPU test machine verl only imports after the placeholders below.

Everything here only makes verl's own engine code runnable on a machine without an accelerator;
none of it changes what the engines compute:
- `install_absent_module_placeholders`: modules verl imports on the engine path but never runs
  there (ray, peft, datasets, ...), placed in `sys.modules` only when they are not installed.
- `use_cpu_platform`: verl's device platform reporting "cpu", so verl allocates on the CPU.
- `engine_call_on_cpu`: megatron-core allocates a few scalars with a hard-coded `device="cuda"`;
  inside this context such factory calls land on the CPU (and torch.compile is off).
- `ReferenceCoreAttention`: plain causal softmax attention for the *stock* engine's model, in both
  of verl's input formats (megatron's local core attention refuses them).
- `tiny_checkpoint`, `build_engine`, `grpo_micro_batch`: the model, the engine and a batch built the
  way verl's trainer builds it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
import types
from pathlib import Path
from typing import List, Optional, Sequence

import torch

# verl imports these on the engine's import path without using them there.
VERL_IMPORT_ONLY_MODULES = ("ray", "peft", "accelerate", "datasets", "pandas", "PIL", "dill", "wandb", "torchdata",
                            # Megatron-Bridge's training config (verl builds its DDP config with it)
                            # imports its data loaders
                            "megatron.energon")


class _ImportOnly:
    """A name from a module that is not installed: importable, fails loudly if used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _ImportOnly(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} belongs to a package that is not installed here (placeholder for the tests)")

    def __mro_entries__(self, bases):
        return (object,)


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: Sequence[str]):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if any(name == root or name.startswith(root + ".") for root in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def module_getattr(item, _name=spec.name):
            if item.startswith("__"):
                raise AttributeError(item)
            return _ImportOnly(f"{_name}.{item}")

        module.__getattr__ = module_getattr
        module.__ps_bridge_placeholder__ = True
        return module

    def exec_module(self, module):
        pass


def install_absent_module_placeholders(names: Sequence[str] = VERL_IMPORT_ONLY_MODULES) -> List[str]:
    """Placeholders for those of `names` that are not installed; returns the ones placed."""
    absent = [n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None]
    if absent and not any(isinstance(f, _PlaceholderFinder) for f in sys.meta_path):
        sys.meta_path.append(_PlaceholderFinder(absent))
    return absent


def prepare_cpu_process() -> None:
    """Imports in the order that works without TE and without an accelerator, then verl."""
    install_absent_module_placeholders()
    from ps_bridge.compat import cuda_on_cpu
    from ps_bridge.compat.te_placeholder import import_megatron_bridge

    cuda_on_cpu.enable()
    import_megatron_bridge()
    use_cpu_platform()
    _megatron_rng_tracker_on_cpu()
    _cuda_streams_on_cpu()


class _CPUStream:
    """What megatron's DDP wrapper does with its initialisation stream, on the CPU: nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cuda_streams_on_cpu() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.Stream = _CPUStream
    torch.cuda.current_stream = lambda device=None: _CPUStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _megatron_rng_tracker_on_cpu() -> None:
    """verl builds the model without `use_cpu_initialization`, so megatron's weight init forks its
    CUDA RNG tracker; without CUDA the tracker forks the CPU generator instead."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def use_cpu_platform() -> None:
    if torch.cuda.is_available():
        return
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class CPUPlatform(PlatformCUDA):
        """verl's CUDA platform with the device name "cpu": verl allocates with get_device_name()."""

        @property
        def device_name(self) -> str:
            return "cpu"

        def current_device(self):
            return torch.device("cpu")  # verl moves batches with .to(get_device_id())

        def is_available(self) -> bool:
            return True

        def synchronize(self, device_index=None) -> None:
            pass

        def empty_cache(self) -> None:
            pass

    if not isinstance(platform_manager._current_platform, CPUPlatform.__mro__[0]):
        platform_manager._current_platform = CPUPlatform()


class _CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and str(kwargs.get("device", "")).startswith("cuda"):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def engine_call_on_cpu():
    """Around every engine call in the tests: megatron's `device="cuda"` factory calls land on the
    CPU, and verl's `torch.compile`d entropy runs eagerly (compiling takes 10-14 s and a C++
    compiler; scoped here rather than TORCHDYNAMO_DISABLE so other tests keep torch.compile)."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        if torch.cuda.is_available():
            yield
            return
        with _CudaFactoriesOnCpu():
            yield


# ---- the stock engine's attention ----------------------------------------------------------


def _causal_attention(q, k, v, key_valid, scale):
    """q [H, S, D], k/v [Hkv, S, D], key_valid [S] -> [H, S, D] (float32 math)."""
    rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, dim=0)
    v = v.repeat_interleave(rep, dim=0)
    S = q.shape[1]
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril() & key_valid[None, :]
    mask |= torch.eye(S, dtype=torch.bool, device=q.device)  # padding queries stay finite
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def _reference_core_attention_class():
    from megatron.core.transformer.module import MegatronModule

    class ReferenceCoreAttention(MegatronModule):
        """Causal softmax attention for verl's stock formats: THD with `cu_seqlens_*_padded`, or
        BSHD `[s, b, h, d]` with verl's `[b, s]` validity mask. The test's ground truth."""

        def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
            super().__init__(config=config)
            self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            if packed_seq_params is not None:
                bounds = packed_seq_params.cu_seqlens_q_padded.tolist()
                out = torch.empty_like(query)
                for a, b in zip(bounds[:-1], bounds[1:]):
                    valid = torch.ones(b - a, dtype=torch.bool, device=query.device)
                    seg = _causal_attention(query[a:b].transpose(0, 1), key[a:b].transpose(0, 1),
                                            value[a:b].transpose(0, 1), valid, self.scale)
                    out[a:b] = seg.transpose(0, 1)
                return out.reshape(out.shape[0], -1)
            S, B = query.shape[:2]
            out = torch.empty_like(query)
            for i in range(B):
                valid = attention_mask[i].bool().reshape(-1)[-S:] if attention_mask is not None else torch.ones(S, dtype=torch.bool)
                seg = _causal_attention(query[:, i].transpose(0, 1), key[:, i].transpose(0, 1),
                                        value[:, i].transpose(0, 1), valid, self.scale)
                out[:, i] = seg.transpose(0, 1)
            return out.reshape(S, B, -1)

    return ReferenceCoreAttention


def reference_gpt_layer_spec(config, vp_stage=None):
    """Our layer spec with the reference core attention: the stock engine's stock-format model.
    Takes the spec as a single layer `ModuleSpec` or as a block (`layer_specs`), whichever the
    prefix-aware spec builder returns."""
    import inspect

    from ps_bridge.models.specs import prefix_shared_gpt_layer_spec

    if "vp_stage" in inspect.signature(prefix_shared_gpt_layer_spec).parameters:
        spec = prefix_shared_gpt_layer_spec(config, vp_stage=vp_stage)
    else:
        spec = prefix_shared_gpt_layer_spec(config)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        layer.submodules.self_attention.submodules.core_attention = _reference_core_attention_class()
    return spec


# ---- model, tokenizer, engine --------------------------------------------------------------


def save_tiny_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` ids; verl reads `pad_token_id` from it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1", bos_token="t2")
    fast.save_pretrained(path)


def tiny_checkpoint(path: str, family: str = "qwen2.5", seed: int = 0):
    """A tiny random HF checkpoint of `family` (ps_bridge.testing.TINY_BUILDERS) plus a tokenizer."""
    from ps_bridge.testing import TINY_BUILDERS

    hf_model = TINY_BUILDERS[family](path, seed=seed)
    save_tiny_tokenizer(path, hf_model.config.vocab_size)
    return hf_model


STOCK_TEST_OVERRIDES = dict(
    apply_rope_fusion=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    bias_dropout_fusion=False,
    gradient_accumulation_fusion=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    attention_backend="auto",
)


def build_engine(engine_cls, ckpt: str, *, use_remove_padding: bool = True, forward_only: bool = True,
                 overrides: Optional[dict] = None, use_fused_kernels: bool = False,
                 external_lib: Optional[str] = None, vanilla_mbridge: bool = False, tp: int = 1,
                 sequence_parallel: bool = False):
    """verl's own constructor and `initialize()` for `engine_cls`, fp32, on the CPU (one process per
    tensor-parallel rank under torchrun, gloo)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig

    from ps_bridge.runtime import init_parallel

    init_parallel(tp=tp)
    model_config = HFModelConfig(path=ckpt, use_remove_padding=use_remove_padding, external_lib=external_lib)
    engine_config = McoreEngineConfig(
        forward_only=forward_only,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_distributed_optimizer=False,
        vanilla_mbridge=vanilla_mbridge,
        override_transformer_config=dict(STOCK_TEST_OVERRIDES, **(overrides or {})),
    )
    # McoreEngineConfig accepts only bf16/fp16 at construction; fp32 makes the comparison exact.
    object.__setattr__(engine_config, "dtype", "float32")
    object.__setattr__(engine_config, "use_remove_padding", use_remove_padding)
    object.__setattr__(engine_config, "use_fused_kernels", use_fused_kernels)
    optimizer_config = McoreOptimizerConfig(lr=1e-3, clip_grad=0.0, weight_decay=0.0, total_training_steps=10, lr_warmup_steps=0)
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
    import numpy as np
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


def prepare_plugin_test_process() -> None:
    """CPU preparation, the stock bridges remembered, then the plugin activated (sharing on)."""
    prepare_cpu_process()
    remember_stock_bridges()
    import ps_bridge.verl as plugin
    from ps_bridge.config import PrefixSharingConfig

    plugin.activate(PrefixSharingConfig(enabled=True))


def build_stock_engine(ckpt: str, **kwargs):
    """verl's stock `MegatronEngineWithLMHead` on Megatron-Bridge's stock provider, with the
    reference core attention (the only non-stock module, needed because none runs on a CPU)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    overrides = dict(kwargs.pop("overrides", None) or {}, transformer_layer_spec=reference_gpt_layer_spec)
    with stock_bridges():
        return build_engine(MegatronEngineWithLMHead, ckpt, overrides=overrides, **kwargs)


# ---- tensor parallelism: one process per rank ---------------------------------------------------


def engine_comparison(ckpt: str, tp: int = 2, sequence_parallel: bool = False) -> dict:
    """On this TP rank (under torch.distributed.run; gloo on a CPU): our engine vs the stock engine, THD and
    BSHD, for `infer_batch` rows and the local shards of the policy-loss gradients (`grad_loss`)."""
    import torch.distributed as dist

    prepare_plugin_test_process()
    from ps_bridge.testing import grpo_like_samples
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine

    samples = grpo_like_samples(256, num_prompts=3, n=4, seed=7, shuffle=False)
    result = {}
    for fmt in ("thd", "bshd"):
        kw = dict(use_remove_padding=fmt == "thd", forward_only=False, tp=tp, sequence_parallel=sequence_parallel)
        engines = {"stock": build_stock_engine(ckpt, **kw), "ours": build_engine(PrefixSharedMegatronEngine, ckpt, **kw)}
        rows, grads = {}, {}
        for name, engine in engines.items():
            with engine_call_on_cpu(), engine.eval_mode():
                rows[name] = engine.infer_batch(grpo_micro_batch(samples, micro_batch_size=4))["model_output"]
            with engine_call_on_cpu(), engine.train_mode():
                engine.optimizer_zero_grad()
                engine.forward_backward_batch(grpo_micro_batch(samples, micro_batch_size=4), grad_loss, forward_only=False)
                grads[name] = {n: p.main_grad.detach().clone() for n, p in engine.module[0].named_parameters()}
        for key in ("log_probs", "entropy"):
            result[f"{fmt}_{key}"] = max((a - b).abs().max().item()
                                         for a, b in zip(rows["ours"][key].unbind(), rows["stock"][key].unbind()))
        result[f"{fmt}_grad_rel"] = max(((grads["ours"][n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
                                        for n, g in grads["stock"].items())
    from megatron.core import parallel_state

    result["rank"] = dist.get_rank()
    result["tp_size"] = parallel_state.get_tensor_model_parallel_world_size()
    return result


def grad_loss(model_output, data, dp_group=None):
    """Response log-probs weighted by the advantages plus entropy, token mean over the mini-batch."""
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = no_padding_2_padding(model_output["entropy"], data)
    padded = data.select("response_mask", "advantages").to_padded_tensor()
    mask = padded["response_mask"].bool()
    loss = (-(log_prob * padded["advantages"]) - 0.01 * entropy)[mask].sum() / data["batch_num_tokens"]
    return loss, {}


if __name__ == "__main__":
    import json

    sp = len(sys.argv) > 2 and sys.argv[2] == "sequence_parallel"
    print("RESULT " + json.dumps(engine_comparison(sys.argv[1], sequence_parallel=sp)), flush=True)
