"""`ps-bridge verl-check`: verl's own trainer step, stock engine vs prefix-shared engine, same weights.

What verl's trainer runs per step (`RayPPOTrainer`: `_compute_old_log_prob`, `_compute_ref_log_prob`,
`_update_actor`; the worker side `verl/workers/engine_workers.py: TrainingWorker.infer_batch /
train_mini_batch`, the loss `verl/workers/utils/losses.py: ppo_loss`) is run here in one process, on
synthetic GRPO data, for two engines built by verl's own constructor from the same checkpoint:

- stock: verl's `MegatronEngineWithLMHead` on Megatron-Bridge's stock provider. Without Transformer
  Engine its core attention is a THD-capable stand-in (`ps_bridge.compat.stock_attention`: the
  flash varlen kernels of our unshared path on a GPU in bf16/fp16, plain softmax attention otherwise).
  For a family whose stock model needs TE and GPU-only kernels (Qwen3.5) the stock engine is our
  engine with sharing off (one sequence per sample, verl's micro-batching): said in the output.
- shared: `PrefixSharedMegatronEngine` (sharing on; prefix-aware token budgets, `engine.py`).

The two run one after the other (each with its own actor and ref engine, freed before the next), on
the same data, so peak memory is each engine's own. The user's verl settings are OmegaConf dotlist
overrides of verl's generated trainer config (`_generated_ppo_megatron_trainer.yaml`); the actor's
and ref's `ActorConfig` come from it through verl's own `omega_conf_to_dataclass`, and the engine
settings are assigned as `ActorRolloutRefWorker.init_model` assigns them.

Modules, one job each: `config` (verl-check's settings, verl's trainer config and the roles'
configs), `model` (the checkpoint, which engine stands for stock), `data` (synthetic GRPO batches,
the ideal ratio S), `roles` (an engine driven as verl's worker drives it, the engines of each kind),
`run` (the trainer steps of each kind, the document), `compare` (stock vs shared per step, the
speed-ups, the smoke's requirements), `report` (the printed table, the JSON), `plot` (the curves).
This module only re-exports their public names.
"""

from dataclasses import asdict

from ps_bridge.tools.verl_check.compare import check_failures, compare, relative_difference, speedups
from ps_bridge.tools.verl_check.config import (
    BUDGET_KEYS, CHECK_DEFAULTS, PHASES, CheckSettings, role_configs, scaled_budgets, to_dataclass, trainer_config,
)
from ps_bridge.tools.verl_check.data import ideal_ratio, synthetic_batch
from ps_bridge.tools.verl_check.model import checkpoint_for, stock_description, stock_kind
from ps_bridge.tools.verl_check.plot import write_plot
from ps_bridge.tools.verl_check.report import format_report, write_json
from ps_bridge.tools.verl_check.roles import Role, build_role_engines, shared_backend
from ps_bridge.tools.verl_check.run import run_check, run_kind

__all__ = [
    "BUDGET_KEYS", "CHECK_DEFAULTS", "PHASES", "CheckSettings", "Role", "asdict", "build_role_engines", "check_failures",
    "checkpoint_for", "compare", "format_report", "ideal_ratio", "relative_difference", "role_configs", "run_check",
    "run_kind", "scaled_budgets", "shared_backend", "speedups", "stock_description", "stock_kind", "synthetic_batch",
    "to_dataclass", "trainer_config", "write_json", "write_plot",
]
