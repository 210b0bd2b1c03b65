"""verl-check's settings and verl's trainer config: verl-check's defaults, the user's dotlist, the
actor's and ref's `ActorConfig` as verl's worker builds them, the token budgets."""

from __future__ import annotations

import dataclasses
import importlib
import os
import typing
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

PHASES = ("old_log_prob", "ref", "update")

# What verl-check sets in verl's trainer config before the user's overrides (a GRPO run with a KL
# loss and dynamic token budgets, as a GRPO trainer runs them).
CHECK_DEFAULTS = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.optim.total_training_steps=1000",  # the trainer sets it from its own length
    "actor_rollout_ref.actor.optim.clip_grad=1.0",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer=False",
    "actor_rollout_ref.actor.megatron.sequence_parallel=False",
    "actor_rollout_ref.ref.megatron.sequence_parallel=False",
    "actor_rollout_ref.model.use_fused_kernels=False",
    # what prefix sharing needs (verl 0.9.1's default; verl 0.8.0 defaults to the legacy mbridge)
    "actor_rollout_ref.actor.megatron.vanilla_mbridge=False",
    "actor_rollout_ref.ref.megatron.vanilla_mbridge=False",
]


@dataclass
class CheckSettings:
    model: str  # an HF checkpoint directory, or a shape name of ps_bridge.tools.bench.catalog.MODEL_SHAPES
    layers: Optional[int] = None  # for a catalogue shape: its layer count (default: the bench's)
    prompts: int = 32
    n: int = 8
    prompt_len: int = 2048  # P: each prompt's own tokens, after the system prompt
    system_prompt_len: int = 0  # N: tokens every prompt begins with (the same ones), shared once by a prefix tree
    tree: Optional[bool] = None  # the shared engine's PrefixSharingConfig.tree (None: its default, PS_BRIDGE_TREE)
    response_len: int = 512  # mean; each response's length is drawn from [R/2, 3R/2]
    steps: int = 5
    dtype: str = "bfloat16"
    seed: int = 0
    overrides: List[str] = field(default_factory=list)
    baseline: str = "stock"  # "stock": verl's stock engine where it runs the family; "off": our engine, sharing off
    # the "off" baseline's CUDA graphs (None: PS_BRIDGE_CUDA_GRAPHS, as the shared engine's)
    baseline_graphs: Optional[bool] = None
    shared_first: bool = False  # run the shared engine's steps before the first engine's
    interleave: bool = False  # both engines resident, their steps in turns (A B, B A, ...): no order effect
    noise_floor: bool = False  # also run stock with 3/4 of the budgets: stock vs stock, other micro-batch splits
    workdir: Optional[str] = None
    images: int = 0  # images per prompt (vision-language checkpoints): each prompt its own, before its P tokens
    image_size: Tuple[int, int] = (1024, 1024)  # pixels (H, W) of each image


def trainer_config(settings: CheckSettings):
    """verl's generated Megatron trainer config with verl-check's defaults and the user's dotlist."""
    # imported here: verl is optional (requirements-verl.txt); omegaconf comes with verl (optional)
    import verl
    from omegaconf import OmegaConf

    path = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_megatron_trainer.yaml")
    cfg = OmegaConf.load(path)
    OmegaConf.set_struct(cfg, True)  # as under hydra: a key verl does not have is an error, not a no-op
    dotlist = CHECK_DEFAULTS + [f"actor_rollout_ref.rollout.n={settings.n}"] + list(settings.overrides)
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))
    except Exception as e:  # noqa: BLE001 - OmegaConf raises several types for a bad key/value
        raise ValueError(f"bad verl setting among {settings.overrides}: {e}") from None
    return cfg


def role_configs(cfg):
    """(actor config, ref config, rollout-level log-prob settings) as verl's worker builds them:
    `McoreActorConfig` built field by field from the resolved subtree (what hydra's `instantiate` of
    the `_target_`s does in verl's worker; hydra is not needed here), the ref's keys renamed as
    `ActorRolloutRefWorker.init_model` renames them."""
    # imported here: omegaconf comes with verl (optional); verl is optional (requirements-verl.txt)
    from omegaconf import OmegaConf
    from verl.workers.config import McoreActorConfig

    arr = OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True)  # interpolations against the root
    actor = to_dataclass(arr["actor"], McoreActorConfig)
    ref_node = dict(arr["ref"])
    ref_node.update(
        ppo_mini_batch_size=arr["actor"]["ppo_mini_batch_size"],
        ppo_micro_batch_size=ref_node.pop("log_prob_micro_batch_size", None),
        ppo_micro_batch_size_per_gpu=ref_node.pop("log_prob_micro_batch_size_per_gpu", None),
        use_dynamic_bsz=ref_node.pop("log_prob_use_dynamic_bsz", False),
        ppo_max_token_len_per_gpu=ref_node.pop("log_prob_max_token_len_per_gpu", None),
    )
    ref = to_dataclass(ref_node, McoreActorConfig)
    rollout = dict(
        use_dynamic_bsz=bool(arr["rollout"]["log_prob_use_dynamic_bsz"]),
        max_token_len=arr["rollout"]["log_prob_max_token_len_per_gpu"],
        micro_batch_size=arr["rollout"]["log_prob_micro_batch_size_per_gpu"],
    )
    return actor, ref, rollout


def to_dataclass(node: dict, cls):
    """`cls(**node)` (or the node's `_target_` class), nested dataclass fields built from their
    sub-dicts, keys the dataclass does not have left out (verl's generated yaml carries a few for other readers)."""
    target = node.get("_target_")
    if target:  # the yaml names the concrete class (e.g. McoreOptimizerConfig for a field typed OptimizerConfig)
        module, _, name = target.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    for key, value in node.items():
        if key not in names:
            continue
        kind = hints.get(key)
        for arg in typing.get_args(kind) or (kind,):  # Optional[X] -> X
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):
                value = to_dataclass(value, arg)
                break
        kwargs[key] = value
    return cls(**kwargs)


BUDGET_KEYS = ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
               "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
               "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu")


def scaled_budgets(cfg, factor: float):
    """`cfg` with every dynamic token budget times `factor` (other micro-batch boundaries)."""
    # imported here: omegaconf comes with verl (optional)
    from omegaconf import OmegaConf

    values = [f"{key}={int(OmegaConf.select(cfg, key) * factor)}" for key in BUDGET_KEYS]
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(values))
