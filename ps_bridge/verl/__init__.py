"""verl plugin: `actor_rollout_ref.model.external_lib=ps_bridge.verl` switches prefix sharing on.

verl imports this module in every worker (when it builds `HFModelConfig`) before any engine exists.
With `ENABLE_PREFIX_SHARING=1` the import
- registers our Megatron-Bridge bridges, so `AutoBridge` builds the prefix-aware model for the actor
  and the ref (verl's Megatron-Bridge path: `actor_rollout_ref.actor.megatron.vanilla_mbridge=False`);
- registers `PrefixSharedMegatronEngine` in verl's `EngineRegistry` under ("cuda", "nvidia") and the
  NPU engine under ("npu", "huawei"), the vendor keys verl 0.9.1 looks up before its stock engines
  (verl 0.8.0: in place of the stock engines under "cuda" and "npu").
With it unset or 0 the import registers nothing and verl runs unchanged.

Backend, provider and prefix trees (on by default; `PS_BRIDGE_TREE=0`: one level) come from
`PS_BRIDGE_BACKEND`, `PS_BRIDGE_PROVIDER` and `PS_BRIDGE_TREE` (`ps_bridge.config`): verl 0.9.1's configs are
structured dataclasses that reject unknown keys such as `actor.prefix_sharing_config.backend`, and the
engine is not handed the actor config anyway (see docs/verl.md).
"""

from __future__ import annotations

import logging
from typing import Optional

from ps_bridge.compat.te_placeholder import import_megatron_bridge
from ps_bridge.config import PrefixSharingConfig, log_level_from_env
from ps_bridge.providers.registry import register_all

logger = logging.getLogger("ps_bridge")

ENGINE_KEYS = (("cuda", "nvidia"), ("npu", "huawei"))


def _ensure_log_handler() -> None:
    """verl configures the root logger at WARNING; the `[PS]` lines are INFO and must reach the log.
    A level already set on our logger (the `ps-bridge` commands set it from `-v`) is kept."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(log_level_from_env())


def register_engines(config: PrefixSharingConfig) -> None:
    """Our engine under verl's keys for NVIDIA GPUs and Huawei NPUs (idempotent); the engine reads
    `config`. verl 0.9.1 keys engines by (device, vendor), 0.8.0 by device (`ps_bridge.compat.verl`).
    Also mends verl's packed mRoPE position ids of equal-length batches (`ps_bridge.compat.verl_position_ids`)."""
    # imported here: torch is heavy; verl is optional (requirements-verl.txt)
    from ps_bridge.compat import verl as verl_compat, verl_position_ids
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine, npu_engine_class

    verl_position_ids.install()
    PrefixSharedMegatronEngine.prefix_sharing_config = config
    npu = npu_engine_class()
    if npu is not None:
        npu.prefix_sharing_config = config
    for (device, vendor), cls in zip(ENGINE_KEYS, (PrefixSharedMegatronEngine, npu)):
        if cls is not None:
            verl_compat.register_engine(cls, "language_model", "megatron", device, vendor)


def activate(config: Optional[PrefixSharingConfig] = None) -> PrefixSharingConfig:
    """Register bridges and engines for `config` (default: from the environment)."""
    config = config or PrefixSharingConfig.from_env()
    _ensure_log_handler()
    logger.info(
        "[PS][prepare] config.enable_prefix_sharing=%s tree=%s backend=%s provider=%s (ps_bridge.verl)",
        config.enabled, config.tree, config.backend, config.provider,
    )
    if not config.enabled:
        return config
    import_megatron_bridge()
    register_all(config)
    register_engines(config)
    return config


ACTIVE_CONFIG = activate()
