"""What differs between the verl releases ps-bridge runs on (0.8.0 and 0.9.1), in one place.

Each function is named by what it adapts and decides by what verl offers (a signature, an
attribute, a module), never by a version string; the engine, the plugin registration, the CPU
preparation and the tests call these instead of checking versions themselves.

| adapts                         | verl 0.9.1                                   | verl 0.8.0                               |
|--------------------------------|----------------------------------------------|------------------------------------------|
| engine registry keys           | (device, vendor), `VERL_ENGINE_DEVICE/VENDOR` | device only, from `get_device_name()`   |
| device platform                | `verl.plugin.platform`                       | `verl.utils.device` (torch's own)        |
| THD label roll                 | `pad_to_length_bucket=`                      | no bucket padding                        |
| BSHD label roll                | `forced_max_seqlen=`                         | padded to the micro-batch's longest      |
| entropy chunking               | `entropy_from_logits_chunk_size`             | no setting: our default chunk            |
| per-token loss (megatron's     | loss returns (sum, tokens, output);          | loss returns (loss, output): refused     |
| `calculate_per_token_loss`)    | `_routed_num_tokens`                         | with `calculate_per_token_loss=True`     |
| optimizer state of a dist-     | `MegatronCheckpointManager.                  | no such step (its older checkpoint       |
| checkpoint load                | _build_optimizer_state_dict`                 | layout)                                  |
| float32 engine optimizer       | `init_megatron_optim_config` takes `bf16`    | bf16 / fp16 only: megatron's fp32 one by |
|                                |                                              | override                                 |
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from importlib.metadata import version
from typing import Optional

# the row chunk of our chunked entropy / log-probs where verl has no setting for it (verl 0.9.1's default)
DEFAULT_ENTROPY_CHUNK_ROWS = 2048


def verl_version() -> str:
    try:
        return version("verl")
    except Exception:  # pragma: no cover - not installed as a distribution
        # imported here: verl is optional (requirements-verl.txt)
        import verl

        return getattr(verl, "__version__", "unknown")


# ---- engine registry -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def registry_takes_vendor() -> bool:
    """verl 0.9.1 keys engines by (device, vendor); 0.8.0 by device alone."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.workers.engine.base import EngineRegistry

    return "vendor" in inspect.signature(EngineRegistry.register).parameters


def engine_registry_key(device: str, vendor: str):
    """The key of verl's engine table under which `device` (made by `vendor`) looks its engine up."""
    return (device, vendor) if registry_takes_vendor() else device


def register_engine(cls, model_type: str, backend: str, device: str, vendor: str) -> None:
    """`cls` as verl's engine for (`model_type`, `backend`) on `device` / `vendor`, in place of what
    was there (verl's `register` refuses (0.9.1) or ignores (0.8.0) a taken key). Idempotent."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.workers.engine.base import EngineRegistry

    table = EngineRegistry._engines.setdefault(model_type, {}).setdefault(backend, {})
    key = engine_registry_key(device, vendor)
    if table.get(key) is cls:
        return
    table.pop(key, None)
    extra = {"vendor": vendor} if registry_takes_vendor() else {}
    EngineRegistry.register(model_type=model_type, backend=backend, device=device, **extra)(cls)


def engine_lookup_honours_device_override() -> None:
    """verl 0.9.1 lets `VERL_ENGINE_DEVICE` / `VERL_ENGINE_VENDOR` pick the engine key (so a machine
    without an accelerator can look up the GPU engine); verl 0.8.0 always takes `get_device_name()`
    ("cpu" there, where no Megatron engine is registered). For the CPU runs only
    (`ps_bridge.compat.verl_on_cpu`): on 0.8.0 the lookup reads `VERL_ENGINE_DEVICE` first."""
    if registry_takes_vendor():
        return
    # imported here: verl is optional (requirements-verl.txt)
    from verl.workers.engine import base

    lookup = base.EngineRegistry.get_engine_cls
    if getattr(lookup, "__ps_bridge__", False):
        return
    stock = lookup.__func__

    def get_engine_cls(cls, model_type: str, backend: str):
        device = os.getenv("VERL_ENGINE_DEVICE")
        if device and device in cls._engines.get(model_type, {}).get(backend, {}):
            return cls._engines[model_type][backend][device]
        return stock(cls, model_type, backend)

    get_engine_cls.__ps_bridge__ = True
    base.EngineRegistry.get_engine_cls = classmethod(get_engine_cls)


# ---- device platform -----------------------------------------------------------------------------


def platform_manager():
    """verl 0.9.1's device-platform manager, or None (verl 0.8.0 reads torch's device directly:
    `get_device_name()` is "cpu" on a machine without an accelerator)."""
    try:
        # imported here: verl is optional (requirements-verl.txt)
        from verl.plugin.platform import platform_manager as manager
    except ImportError:
        return None
    return manager


# ---- labels, as the stock engine forms them -----------------------------------------------------


@functools.lru_cache(maxsize=None)
def _takes(func, name: str) -> bool:
    return name in inspect.signature(func).parameters


def length_bucket(engine_config) -> Optional[int]:
    """The THD pack's length bucket (verl 0.9.1's `pad_to_length` / `pad_to_length_bucket`), or None
    (off, or verl 0.8.0, which has neither setting)."""
    if getattr(engine_config, "pad_to_length", False):
        return engine_config.pad_to_length_bucket
    return None


def roll_thd_labels(labels, use_fp8_padding: bool, pad_to_length_bucket: Optional[int]):
    """verl's `preprocess_thd_engine` label roll: (rolled [1, T], packed_seq_params)."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.models.mcore.util import preprocess_thd_engine

    kwargs = dict(pre_process=True, need_roll=True, use_fp8_padding=use_fp8_padding)
    if _takes(preprocess_thd_engine, "pad_to_length_bucket"):
        kwargs["pad_to_length_bucket"] = pad_to_length_bucket
    elif pad_to_length_bucket is not None:  # a setting verl 0.8.0 does not have; cannot be reached from its configs
        raise ValueError(f"verl {verl_version()} has no pad_to_length_bucket: set actor_rollout_ref.actor.megatron."
                         "pad_to_length=False")
    rolled, params, _ = preprocess_thd_engine(labels, **kwargs)
    return rolled, params


def roll_bshd_labels(labels, use_fp8_padding: bool, forced_max_seqlen: Optional[int]):
    """verl's `preprocess_bshd_engine` label roll: rolled [B, S]."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.models.mcore.util import preprocess_bshd_engine

    kwargs = dict(pre_process=True, need_roll=True, use_fp8_padding=use_fp8_padding)
    if _takes(preprocess_bshd_engine, "forced_max_seqlen"):
        kwargs["forced_max_seqlen"] = forced_max_seqlen
    # verl 0.8.0 never sets forced_max_seqlen (it pads BSHD to each micro-batch's longest row)
    rolled, _, _ = preprocess_bshd_engine(labels, **kwargs)
    return rolled


# ---- entropy / log-prob chunking ------------------------------------------------------------------


def entropy_chunk_rows(engine_config) -> int:
    """Rows per chunk of the vocabulary-parallel entropy and log-probs: verl 0.9.1's
    `entropy_from_logits_chunk_size`; verl 0.8.0 has no such setting (its stock engine takes the
    entropy of the whole logits at once): ours chunks by `DEFAULT_ENTROPY_CHUNK_ROWS` (the values
    do not depend on the chunk)."""
    return int(getattr(engine_config, "entropy_from_logits_chunk_size", DEFAULT_ENTROPY_CHUNK_ROWS))


# ---- megatron's per-token-loss regime ---------------------------------------------------------


@functools.lru_cache(maxsize=None)
def loss_returns_token_count() -> bool:
    """verl 0.9.1's Megatron engine returns (loss sum, tokens, output) to megatron when
    `calculate_per_token_loss=True` (counting tokens with `_routed_num_tokens`); verl 0.8.0 always
    returns (loss, output)."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    return hasattr(MegatronEngine, "_routed_num_tokens")


def check_per_token_loss(tf_config) -> None:
    """Refuse megatron's per-token-loss regime where verl's loss gives megatron no token count:
    megatron then sums the gradients over data-parallel ranks (per-token regime) without dividing
    by any token count, a silently wrong gradient."""
    if getattr(tf_config, "calculate_per_token_loss", False) and not loss_returns_token_count():
        raise NotImplementedError(
            f"verl {verl_version()}'s Megatron engine returns no token count from its loss, which megatron's "
            "calculate_per_token_loss=True needs (the gradients would be summed, not averaged): set "
            "actor_rollout_ref.actor.megatron.override_transformer_config.calculate_per_token_loss=False "
            "(and for the ref), or use verl >= 0.9"
        )


# ---- padding helpers without flash-attn ----------------------------------------------------------


def _index_first_axis(tensor, indices):
    return tensor[indices]


def _unpad_input(hidden_states, attention_mask, unused_mask=None):
    """[b, s, ...] and a [b, s] mask -> (valid rows [n, ...], their flat indices, cu_seqlens,
    longest row, row lengths), the contract verl's `unpad_input` callers read."""
    # imported here: torch is heavy
    import torch

    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()), attention_mask.sum(dim=-1, dtype=torch.int32)


def _pad_input(hidden_states, indices, batch, seqlen):
    """Rows [n, ...] back to [batch, seqlen, ...] at their flat `indices`, zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def _rearrange(*args, **kwargs):
    # imported here: einops comes with the optional GPU kernels
    from einops import rearrange

    return rearrange(*args, **kwargs)


def padding_helpers_without_flash_attn() -> bool:
    """verl 0.9.1 falls back to torch for its padding helpers (`verl.utils.attention_utils`) where
    flash-attn is absent; verl 0.8.0 imports them from flash-attn (a GPU package) on every call.
    There, with flash-attn absent, these torch ones answer instead. Returns whether they were put in."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.utils import attention_utils

    if importlib.util.find_spec("flash_attn") is not None or hasattr(attention_utils, "_fallback_unpad_input"):
        return False
    if getattr(attention_utils._get_attention_functions, "__ps_bridge__", False):
        return True
    # imported here: verl is optional (requirements-verl.txt)
    from verl.utils.device import is_torch_npu_available

    stock = attention_utils._get_attention_functions

    def _get_attention_functions():
        if is_torch_npu_available(check_device=False):
            return stock()
        return _index_first_axis, _pad_input, _rearrange, _unpad_input

    _get_attention_functions.__ps_bridge__ = True
    attention_utils._get_attention_functions = _get_attention_functions
    return True


# ---- the optimizer of a float32 engine ----------------------------------------------------------


def fp32_optimizer_overrides(dtype: str) -> dict:
    """`McoreOptimizerConfig.override_optimizer_config` entries for an engine whose parameters are
    `dtype`: verl 0.9.1 builds megatron's float32 optimizer for float32 parameters itself; verl 0.8.0
    knows bf16 and fp16 only (megatron's mixed-precision wrapper, which refuses float32 CPU
    tensors), so a float32 engine (the tests' and `verl-check`'s exact comparisons) asks for
    megatron's float32 optimizer through verl's own override."""
    # imported here: verl is optional (requirements-verl.txt)
    import torch
    from verl.utils.megatron.optimizer import init_megatron_optim_config

    if dtype not in ("float32", "fp32") or "bf16" in inspect.signature(init_megatron_optim_config).parameters:
        return {}
    return {"bf16": False, "fp16": False, "params_dtype": torch.float32}


# ---- checkpoint manager ---------------------------------------------------------------------------


def optimizer_state_dict_builder(manager_cls):
    """verl 0.9.1's `MegatronCheckpointManager._build_optimizer_state_dict` (the unbound function of
    `manager_cls`): the step of its checkpoint layout that builds the optimizer's sharded state from
    the model's. verl 0.8.0's manager (an older checkpoint layout) has no such step: None."""
    return getattr(manager_cls, "_build_optimizer_state_dict", None)
