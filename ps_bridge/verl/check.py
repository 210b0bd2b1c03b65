"""`ps-bridge verl-check`: verl's own trainer step, stock engine vs prefix-shared engine, same weights.

What verl's trainer runs per step (`RayPPOTrainer`: `_compute_old_log_prob`, `_compute_ref_log_prob`,
`_update_actor`; the worker side `verl/workers/engine_workers.py: TrainingWorker.infer_batch /
train_mini_batch`, the loss `verl/workers/utils/losses.py: ppo_loss`) is run here in one process, on
synthetic GRPO data, for two engines built by verl's own constructor from the same checkpoint:

- stock: verl's `MegatronEngineWithLMHead` on Megatron-Bridge's stock provider. Without Transformer
  Engine its core attention is a THD-capable stand-in (`side_by_side.ReferenceCoreAttention`: the
  flash varlen kernels of our unshared path on a GPU in bf16/fp16, plain softmax attention otherwise).
  For a family whose stock model needs TE and GPU-only kernels (Qwen3.5) the stock engine is our
  engine with sharing off (one sequence per sample, verl's micro-batching): said in the output.
- shared: `PrefixSharedMegatronEngine` (sharing on; prefix-aware token budgets, `engine.py`).

The two run one after the other (each with its own actor and ref engine, freed before the next), on
the same data, so peak memory is each engine's own. The user's verl settings are OmegaConf dotlist
overrides of verl's generated trainer config (`_generated_ppo_megatron_trainer.yaml`); the actor's
and ref's `ActorConfig` come from it through verl's own `omega_conf_to_dataclass`, and the engine
settings are assigned as `ActorRolloutRefWorker.init_model` assigns them.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional

import torch

PHASES = ("old_log_prob", "ref", "update")

# What verl-check sets in verl's trainer config before the user's overrides (a GRPO run with a KL
# loss and dynamic token budgets, as the issue's measurements use).
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
    model: str  # an HF checkpoint directory, or a shape name of ps_bridge.bench.catalog.MODEL_SHAPES
    layers: Optional[int] = None  # for a catalogue shape: its layer count (default: the bench's)
    prompts: int = 32
    n: int = 8
    prompt_len: int = 2048
    response_len: int = 512  # mean; each response's length is drawn from [R/2, 3R/2]
    steps: int = 5
    dtype: str = "bfloat16"
    seed: int = 0
    overrides: List[str] = field(default_factory=list)
    noise_floor: bool = False  # also run stock with 3/4 of the budgets: stock vs stock, other micro-batch splits
    workdir: Optional[str] = None


# ---- verl's trainer config ------------------------------------------------------------------------


def trainer_config(settings: CheckSettings):
    """verl's generated Megatron trainer config with verl-check's defaults and the user's dotlist."""
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
    import dataclasses
    import importlib
    import typing

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
    from omegaconf import OmegaConf

    values = [f"{key}={int(OmegaConf.select(cfg, key) * factor)}" for key in BUDGET_KEYS]
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(values))


# ---- the model --------------------------------------------------------------------------------------


def checkpoint_for(settings: CheckSettings, workdir: str) -> str:
    """`settings.model` as an HF checkpoint directory with a tokenizer: as given, or a random one of
    a catalogue shape (written once into `workdir`)."""
    from ps_bridge.bench.catalog import FAMILIES, MODEL_SHAPES

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
    from transformers import AutoModelForCausalLM

    from ps_bridge.verl.side_by_side import save_tiny_tokenizer

    hf_config = FAMILIES[shape.family](shape.dims, layers)
    torch.manual_seed(settings.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if settings.dtype == "float32" else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(path)
    del model
    _free()
    save_tiny_tokenizer(path, hf_config.vocab_size)
    return path


def stock_kind(ckpt: str) -> str:
    """'verl' when verl's stock engine can run this family here, else 'ps-bridge-unshared'."""
    from transformers import AutoConfig

    archs = AutoConfig.from_pretrained(ckpt).architectures or []
    return "verl" if any(a.startswith("Qwen2") for a in archs) else "ps-bridge-unshared"


# ---- synthetic GRPO data -----------------------------------------------------------------------------


def synthetic_batch(settings: CheckSettings, vocab: int, step: int, algo_cfg):
    """One trainer step's batch as the trainer holds it after the rollout: left-padded prompts,
    right-padded responses, uid, random outcome rewards and verl's GRPO advantages."""
    import numpy as np
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    g = torch.Generator().manual_seed(settings.seed * 1000 + step)
    P, R, n = settings.prompt_len, settings.response_len, settings.n
    B = settings.prompts * n
    lo, hi = max(1, R // 2), max(1, R + R // 2)
    lengths = torch.randint(lo, hi + 1, (B,), generator=g)
    Rmax = int(lengths.max())
    prompts = torch.randint(3, vocab, (settings.prompts, P), generator=g).repeat_interleave(n, dim=0)
    responses = torch.randint(3, vocab, (B, Rmax), generator=g)
    response_mask = (torch.arange(Rmax)[None, :] < lengths[:, None]).long()
    responses = responses * response_mask
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    rewards = torch.zeros(B, Rmax)
    rewards[torch.arange(B), lengths - 1] = torch.rand(B, generator=g)
    uid = np.array([f"s{step}p{i // n}" for i in range(B)], dtype=object)
    advantages, returns = compute_grpo_outcome_advantage(
        rewards, response_mask, uid, norm_adv_by_std_in_grpo=algo_cfg.get("norm_adv_by_std_in_grpo", True))
    batch = DataProto.from_dict(
        tensors=dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], dim=1),
                     attention_mask=attention_mask, position_ids=position_ids, response_mask=response_mask,
                     token_level_rewards=rewards, advantages=advantages, returns=returns),
        non_tensors={"uid": uid},
    )
    return batch, lengths.tolist()


def ideal_ratio(settings: CheckSettings, response_lengths: List[int]) -> float:
    """S = sum of n(P + R_j) over sum of (P + sum R_j): the batch's unshared / shared token ratio."""
    P, n = settings.prompt_len, settings.n
    unshared = sum(P + r for r in response_lengths)
    groups = [response_lengths[i:i + n] for i in range(0, len(response_lengths), n)]
    shared = sum(P + sum(g) for g in groups)
    return unshared / shared


# ---- one engine kind: actor + ref, T trainer steps ----------------------------------------------------


class _Role:
    """One role's engine driven as verl's `TrainingWorker` drives it (`verl/workers/engine_workers.py`:
    `infer_batch`, `train_mini_batch` -> `train_batch`), in this process: the same default keys, the
    same mini-batch iterator (`tu.make_iterator`), the same learning-rate step, the loss summed over
    micro-batches. (That module itself imports Ray-side packages, psutil among them, that the CPU
    runs and the GPU archive do not carry, so its loop is followed here rather than imported.)
    Counts the micro-batches verl's `forward_backward_batch` formed."""

    def __init__(self, engine, loss_fn):
        self.engine = engine
        self.loss_fn = loss_fn
        self.micro_batches = 0
        inner = engine.forward_backward_batch

        def counting(data, loss_function, forward_only=False):
            from verl.utils import tensordict_utils as tu

            out = inner(data, loss_function, forward_only=forward_only)
            self.micro_batches += int(tu.get_non_tensor_data(data, key="num_micro_batch", default=0))
            return out

        engine.forward_backward_batch = counting

    def _defaults(self, td, infer: bool) -> None:
        from verl.utils import tensordict_utils as tu

        cfg = self.engine.engine_config
        defaults = dict(
            use_remove_padding=self.engine.model_config.get("use_remove_padding", False),
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            max_token_len_per_gpu=cfg.infer_max_token_len_per_gpu if infer else cfg.max_token_len_per_gpu,
            micro_batch_size_per_gpu=cfg.infer_micro_batch_size_per_gpu if infer else cfg.micro_batch_size_per_gpu,
            use_fused_kernels=cfg.use_fused_kernels,
        )
        for key, val in defaults.items():
            if key not in td.keys():
                tu.assign_non_tensor(td, **{key: val})

    def infer(self, td) -> dict:
        """TrainingWorker.infer_batch: the model outputs (log_probs, entropy) as nested rows."""
        self._defaults(td, infer=True)
        with self.engine.eval_mode():
            output = self.engine.infer_batch(td, loss_function=None)
        return output["model_output"]

    def train(self, td) -> dict:
        """TrainingWorker.train_mini_batch: per mini-batch loss (summed over its micro-batches, as the
        worker's `_postprocess_output`), grad norm, and the loss function's KL metric."""
        from tensordict import NonTensorData
        from verl.utils import tensordict_utils as tu

        mini = tu.pop(td, key="mini_batch_size") // self.engine.get_data_parallel_size()
        epochs = tu.pop(td, key="epochs", default=1)
        seed = tu.pop(td, key="seed", default=42)
        kwargs = tu.pop(td, key="dataloader_kwargs", default={})
        loader = tu.make_iterator(td, mini_batch_size=mini, epochs=epochs,
                                  seed=seed + self.engine.get_data_parallel_rank(), dataloader_kwargs=kwargs)
        total = td.shape[0] // mini * epochs
        metrics = {"loss": [], "grad_norm": [], "kl_loss": []}
        with self.engine.train_mode():
            for i, mb in enumerate(loader):
                tu.assign_non_tensor(mb, global_token_num=NonTensorData(mb["input_ids"].offsets().diff().tolist()),
                                     update_lr_scheduler=i == total - 1, disable_auto_offload=True)
                self._defaults(mb, infer=False)
                out = self.engine.train_batch(mb, loss_function=self.loss_fn)
                if i == total - 1:
                    self.engine.lr_scheduler_step()
                metrics["loss"].append(float(torch.stack([torch.as_tensor(x).float().cpu() for x in out["loss"]]).sum()))
                grad_norm = out["metrics"].get("grad_norm")
                metrics["grad_norm"].append(float(grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm))
                kl = out["metrics"].get("kl_loss")
                if kl is not None:
                    metrics["kl_loss"].append(_metric_value(kl))
        return metrics


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_reset():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def build_role_engines(kind: str, ckpt: str, settings: CheckSettings, actor_cfg, ref_cfg, rollout):
    """(actor engine, ref engine) of `kind` ('stock', 'shared', 'stock-split'), built by verl."""
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine
    from ps_bridge.verl.side_by_side import build_engine, build_stock_engine

    def one(cfg, forward_only, infer_budget):
        engine_cfg = cfg.engine
        engine_cfg.use_dynamic_bsz = cfg.use_dynamic_bsz
        engine_cfg.max_token_len_per_gpu = cfg.ppo_max_token_len_per_gpu
        engine_cfg.micro_batch_size_per_gpu = cfg.ppo_micro_batch_size_per_gpu
        engine_cfg.infer_max_token_len_per_gpu = infer_budget
        engine_cfg.infer_micro_batch_size_per_gpu = (
            rollout["micro_batch_size"] if not forward_only else cfg.ppo_micro_batch_size_per_gpu)
        kw = dict(engine_config=engine_cfg, optimizer_config=cfg.optim, forward_only=forward_only,
                  dtype=settings.dtype, use_remove_padding=True)
        if kind == "shared":
            engine = build_engine(PrefixSharedMegatronEngine, ckpt, **kw)
            engine.prefix_sharing_config = PrefixSharingConfig.from_env(enabled=True, backend=_shared_backend(settings))
        elif stock_kind(ckpt) == "verl":
            engine = build_stock_engine(ckpt, **kw)
        else:
            engine = build_engine(PrefixSharedMegatronEngine, ckpt, **kw)
            engine.prefix_sharing_config = PrefixSharingConfig.from_env(enabled=False, backend=_shared_backend(settings))
        return engine

    actor = one(actor_cfg, False, rollout["max_token_len"])
    ref = one(ref_cfg, True, ref_cfg.ppo_max_token_len_per_gpu)
    return actor, ref


def _shared_backend(settings: CheckSettings) -> str:
    from ps_bridge.config import PrefixSharingConfig

    env = PrefixSharingConfig.from_env(enabled=True).backend
    if env != "torch_ref" or not torch.cuda.is_available() or settings.dtype == "float32":
        return env
    return "auto"


def run_kind(kind: str, settings: CheckSettings, ckpt: str, cfg, batches, progress: Callable[[str], None]) -> List[dict]:
    """T trainer steps with engines of `kind`; per step the padded old/ref log-probs and entropy
    (float32, CPU), the update's per-mini-batch loss / grad norm / KL, phase times, micro-batch
    counts, peak memory per phase."""
    from verl.protocol import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu

    if kind == "stock-split":  # the noise floor: stock with different micro-batch boundaries
        cfg = scaled_budgets(cfg, 0.75)
    actor_cfg, ref_cfg, rollout = role_configs(cfg)
    resident_before = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
    actor_engine, ref_engine = build_role_engines(kind, ckpt, settings, actor_cfg, ref_cfg, rollout)
    actor_cfg.model_config = actor_engine.model_config
    actor = _Role(actor_engine, partial(ppo_loss, config=actor_cfg))
    ref = _Role(ref_engine, None)
    arr = cfg.actor_rollout_ref
    results = []
    for step, batch in enumerate(batches):
        batch.meta_info["temperature"] = arr.rollout.temperature  # as the rollout leaves it
        # resident_before: what an earlier engine kind left allocated (included in this kind's peaks)
        record: Dict = {"phase_seconds": {}, "peak_memory_gib": {"resident_before": resident_before},
                        "micro_batches": {}}

        def phase(name, fn, role):
            _sync()
            _peak_reset()
            before = role.micro_batches
            t0 = time.perf_counter()
            with engine_call_on_cpu():
                out = fn()
            _sync()
            record["phase_seconds"][name] = time.perf_counter() - t0
            record["peak_memory_gib"][name] = _peak_gib()
            record["micro_batches"][name] = role.micro_batches - before
            progress(f"{kind} step {step + 1}: {name}")
            return out

        # old log-probs (RayPPOTrainer._compute_old_log_prob)
        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
        out = phase("old_log_prob", lambda: actor.infer(td), actor)
        old = no_padding_2_padding(out["log_probs"], td).float()
        entropy = no_padding_2_padding(out["entropy"], td).float()
        # ref log-probs (RayPPOTrainer._compute_ref_log_prob)
        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
        out = phase("ref", lambda: ref.infer(td), ref)
        ref_lp = no_padding_2_padding(out["log_probs"], td).float()
        # the update (RayPPOTrainer._update_actor)
        upd = DataProto.from_dict(tensors=dict(batch.batch.items(), old_log_probs=old, ref_log_prob=ref_lp),
                                  non_tensors=dict(batch.non_tensor_batch), meta_info=dict(batch.meta_info))
        td = left_right_2_no_padding(upd.to_tensordict())
        mini = int(arr.actor.ppo_mini_batch_size) * settings.n
        tu.assign_non_tensor(
            td, calculate_entropy=bool(arr.actor.calculate_entropy or arr.actor.entropy_coeff != 0.0),
            distillation_use_topk=False, distillation_only=False, global_batch_size=mini, mini_batch_size=mini,
            epochs=int(arr.actor.ppo_epochs), seed=int(arr.actor.data_loader_seed),
            dataloader_kwargs={"shuffle": bool(arr.actor.shuffle)}, compute_loss=True,
        )
        metrics = phase("update", lambda: actor.train(td), actor)
        # the comparison runs on the CPU, whatever device the engines returned their rows on
        old, ref_lp, entropy = old.cpu(), ref_lp.cpu(), entropy.cpu()
        mask = batch.batch["response_mask"].bool().cpu()
        losses = [float(x) for x in _as_list(metrics.get("loss"))]
        norms = [float(x) for x in _as_list(metrics.get("grad_norm"))]
        kls = metrics.get("kl_loss", [])
        record.update(
            old=old.masked_fill(~mask, 0.0), ref=ref_lp.masked_fill(~mask, 0.0),
            entropy=entropy.masked_fill(~mask, 0.0), losses=losses, grad_norms=norms,
            kl=(sum(kls) / len(kls)) if kls else _kl(old, ref_lp, mask, actor_cfg.kl_loss_type),
        )
        results.append(record)
    del actor, ref, actor_engine, ref_engine
    _free()
    return results


def _as_list(value):
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _metric_value(x) -> float:
    """A verl `Metric` (or a list of per-micro-batch ones) aggregated as verl aggregates it."""
    if isinstance(x, list):
        from verl.utils.metric.utils import Metric

        return float(Metric.aggregate_dp(x)) if x and isinstance(x[0], Metric) else float(sum(x))
    return float(x.aggregate()) if hasattr(x, "aggregate") else float(x)


def _kl(old, ref, mask, kind: str) -> float:
    from verl.trainer.ppo.core_algos import kl_penalty

    return float(kl_penalty(old, ref, kl_penalty=kind)[mask].mean())


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the comparison -------------------------------------------------------------------------------


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def compare(stock: List[dict], shared: List[dict], names=("stock", "shared")) -> List[dict]:
    """Per step, the issue's JSON record."""
    steps = []
    a, b = names
    for t, (s, p) in enumerate(zip(stock, shared)):
        updates = [{"loss": {a: ls, b: lp}, "grad_norm": {a: gs, b: gp}}
                   for ls, lp, gs, gp in zip(s["losses"], p["losses"], s["grad_norms"], p["grad_norms"])]
        last = updates[-1] if updates else {"loss": {a: None, b: None}, "grad_norm": {a: None, b: None}}
        steps.append({
            "step": t + 1,
            "logprob_max_abs_diff": _max_abs(s["old"], p["old"]),
            "ref_logprob_max_abs_diff": _max_abs(s["ref"], p["ref"]),
            "entropy_max_abs_diff": _max_abs(s["entropy"], p["entropy"]),
            "loss": last["loss"],
            "grad_norm": last["grad_norm"],
            "updates": updates,
            "kl": {a: s["kl"], b: p["kl"]},
            "phase_seconds": {a: s["phase_seconds"], b: p["phase_seconds"]},
            "micro_batches": {a: sum(s["micro_batches"].values()), b: sum(p["micro_batches"].values())},
            "peak_memory_gib": {a: s["peak_memory_gib"], b: p["peak_memory_gib"]},
        })
    return steps


def speedups(steps: List[dict], names=("stock", "shared"), skip_first: bool = True) -> Dict[str, float]:
    """Per phase, stock time / shared time summed over the steps (the first left out when there are
    more: it carries one-off compilation and autotuning)."""
    a, b = names
    use = steps[1:] if skip_first and len(steps) > 1 else steps
    out = {}
    for ph in PHASES:
        ta = sum(s["phase_seconds"][a][ph] for s in use)
        tb = sum(s["phase_seconds"][b][ph] for s in use)
        out[ph] = ta / tb if tb > 0 else float("nan")
    return out


def run_check(settings: CheckSettings, progress: Optional[Callable[[str], None]] = None,
              on_result: Optional[Callable[[dict], None]] = None) -> dict:
    """Build both engines in turn, run the steps, compare: the `--json` document. `on_result` gets the
    document as soon as stock and shared are compared, and again with the noise floor (so a run cut
    short during the noise floor still leaves the comparison)."""
    import tempfile

    from omegaconf import OmegaConf

    progress = progress or (lambda msg: None)
    if settings.dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"--dtype {settings.dtype!r}: use bfloat16, float16 or float32")
    workdir = settings.workdir or tempfile.mkdtemp(prefix="ps-bridge-verl-check-")
    cfg = trainer_config(settings)
    ckpt = checkpoint_for(settings, workdir)
    progress("checkpoint ready")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(ckpt).get_text_config().vocab_size
    algo = OmegaConf.to_container(cfg.algorithm, resolve=True)
    mini = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    if settings.prompts % mini:
        raise ValueError(f"--prompts {settings.prompts} is not a multiple of actor_rollout_ref.actor."
                         f"ppo_mini_batch_size={mini} (prompts per mini-batch)")
    batches, lengths = [], []
    for t in range(settings.steps):
        b, ls = synthetic_batch(settings, vocab, t, algo)
        batches.append(b)
        lengths.extend(ls)
    names = ("stock", "shared")
    runs = {kind: run_kind(kind, settings, ckpt, cfg, batches, progress) for kind in ("stock", "shared")}
    steps = compare(runs["stock"], runs["shared"], names)
    arr = cfg.actor_rollout_ref
    config = {
        "model": settings.model, "checkpoint": ckpt, "layers": settings.layers, "prompts": settings.prompts,
        "n": settings.n, "prompt_len": settings.prompt_len, "response_len_mean": settings.response_len,
        "steps": settings.steps, "dtype": settings.dtype, "seed": settings.seed,
        "overrides": list(settings.overrides), "ideal_speedup_S": ideal_ratio(settings, lengths),
        "mini_batch_prompts": mini,
        "ppo_max_token_len_per_gpu": arr.actor.ppo_max_token_len_per_gpu,
        "log_prob_max_token_len_per_gpu": arr.rollout.log_prob_max_token_len_per_gpu,
        "ref_log_prob_max_token_len_per_gpu": arr.ref.log_prob_max_token_len_per_gpu,
        "stock_engine": stock_description(ckpt, settings),
        "shared_backend": _shared_backend(settings),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "speedup": speedups(steps, names),
    }
    doc = {"config": config, "steps": steps}
    if settings.noise_floor:
        if on_result is not None:
            on_result(doc)
        runs["stock-split"] = run_kind("stock-split", settings, ckpt, cfg, batches, progress)
        # the same schema, "shared" standing for the stock engine at 3/4 of the token budgets
        floor = compare(runs["stock"], runs["stock-split"], names)
        doc["noise_floor"] = {"second_engine": "stock, every token budget x 3/4 (other micro-batch boundaries)",
                              "steps": floor}
    if on_result is not None:
        on_result(doc)
    return doc


def stock_description(ckpt: str, settings: CheckSettings) -> str:
    from ps_bridge.verl.side_by_side import stock_attention_name

    if stock_kind(ckpt) == "verl":
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(settings.dtype, torch.float32)
        return f"verl MegatronEngineWithLMHead, Megatron-Bridge stock provider, core attention: {stock_attention_name(dtype)}"
    return ("ps-bridge engine with sharing off (one sequence per sample; verl's stock model of this family "
            "needs Transformer Engine)")


def relative_difference(a: float, b: float, floor: float = 1e-6) -> float:
    """|a - b| relative to the larger magnitude; below `floor` (a loss whose terms cancel, e.g. GRPO
    advantages summing to 0 over a mini-batch at ratio 1) the difference counts absolutely."""
    return abs(a - b) / max(abs(a), abs(b), floor)


def check_failures(doc: dict, logprob_tol: float = 1e-5, rel_tol: float = 1e-5) -> List[str]:
    """What the fp32 smoke requires, as messages (empty when it holds)."""
    bad = []

    rel = relative_difference

    for s in doc["steps"]:
        t = s["step"]
        for key in ("logprob_max_abs_diff", "ref_logprob_max_abs_diff"):
            if not s[key] <= logprob_tol:
                bad.append(f"step {t}: {key} {s[key]:.3g} > {logprob_tol}")
        for u, upd in enumerate(s["updates"]):
            for key in ("loss", "grad_norm"):
                a, b = upd[key]["stock"], upd[key]["shared"]
                if not rel(a, b) <= rel_tol:
                    bad.append(f"step {t} update {u + 1}: {key} stock {a:.8g} vs shared {b:.8g}")
        if not s["micro_batches"]["shared"] <= s["micro_batches"]["stock"]:
            bad.append(f"step {t}: shared ran {s['micro_batches']['shared']} micro-batches, stock "
                       f"{s['micro_batches']['stock']}")
    return bad


def write_json(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))


__all__ = ["CheckSettings", "run_check", "check_failures", "write_json", "ideal_ratio", "speedups", "asdict"]


# ---- output -----------------------------------------------------------------------------------------


def format_report(doc: dict) -> str:
    """The per-step table and the speed-up summary the command prints."""
    cfg, steps = doc["config"], doc["steps"]
    a, b = "stock", "shared"
    lines = [
        f"model {cfg['model']} ({cfg['dtype']}, {cfg['device']}); {cfg['prompts']} prompts x n={cfg['n']}, "
        f"P={cfg['prompt_len']}, R mean {cfg['response_len_mean']}; S = {cfg['ideal_speedup_S']:.2f}",
        f"stock engine: {cfg['stock_engine']}",
        f"prefix-shared engine: backend {cfg['shared_backend']}",
        "step  logp|d|   ref|d|    ent|d|    loss stock/shared         gnorm stock/shared        "
        "mb st/sh  t_old st/sh   t_ref st/sh   t_upd st/sh",
    ]

    def f(x, spec=".3g"):
        return "-" if x is None else format(x, spec)

    for s in steps:
        ps = s["phase_seconds"]
        lines.append(
            f"{s['step']:>4}  {s['logprob_max_abs_diff']:.2e}  {s['ref_logprob_max_abs_diff']:.2e}  "
            f"{s['entropy_max_abs_diff']:.2e}  {f(s['loss'][a], '.6g'):>11}/{f(s['loss'][b], '.6g'):<11}  "
            f"{f(s['grad_norm'][a], '.6g'):>11}/{f(s['grad_norm'][b], '.6g'):<11}  "
            f"{s['micro_batches'][a]:>3}/{s['micro_batches'][b]:<3}  "
            + "  ".join(f"{ps[a][ph]:6.2f}/{ps[b][ph]:<6.2f}" for ph in PHASES)
        )
    if "noise_floor" in doc:
        for s in doc["noise_floor"]["steps"]:
            ups = s["updates"]
            rel = max((relative_difference(u[k][a], u[k][b]) for u in ups for k in ("loss", "grad_norm")), default=0.0)
            lines.append(f"noise floor step {s['step']} (stock vs stock, budgets x 3/4): logp|d| "
                         f"{s['logprob_max_abs_diff']:.2e}, ref|d| {s['ref_logprob_max_abs_diff']:.2e}, "
                         f"ent|d| {s['entropy_max_abs_diff']:.2e}, loss/grad-norm rel {rel:.2e}, "
                         f"micro-batches {s['micro_batches'][a]}/{s['micro_batches'][b]}")
    sp = cfg["speedup"]
    lines.append("speed-up (stock time / shared time, steps after the first): "
                 + ", ".join(f"{ph} {sp[ph]:.2f}x ({sp[ph] / cfg['ideal_speedup_S']:.2f} S)" for ph in PHASES))
    peaks = [(s["peak_memory_gib"][a].get("update"), s["peak_memory_gib"][b].get("update")) for s in steps]
    if peaks and peaks[0][0] is not None:
        pa, pb = max(p[0] for p in peaks), max(p[1] for p in peaks)
        lines.append(f"update-phase peak memory: stock {pa:.2f} GiB, shared {pb:.2f} GiB ({pb / pa:.2f}x)")
    return "\n".join(lines)


def write_plot(doc: dict, path: str) -> None:
    """Per optimizer step loss and grad norm of both engines; per step phase times; log-prob diffs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from None
    steps = doc["steps"]
    a, b = "stock", "shared"
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    updates = [u for s in steps for u in s["updates"]]
    x = range(1, len(updates) + 1)
    for name, style in ((a, "-o"), (b, "--x")):
        ax[0][0].plot(x, [u["loss"][name] for u in updates], style, label=name)
        ax[0][1].plot(x, [u["grad_norm"][name] for u in updates], style, label=name)
    ax[0][0].set(title="loss per optimizer step", xlabel="optimizer step")
    ax[0][1].set(title="grad norm per optimizer step", xlabel="optimizer step")
    t = [s["step"] for s in steps]
    for ph, color in zip(PHASES, ("C0", "C1", "C2")):
        ax[1][0].plot(t, [s["phase_seconds"][a][ph] for s in steps], "-o", color=color, label=f"{ph} {a}")
        ax[1][0].plot(t, [s["phase_seconds"][b][ph] for s in steps], "--x", color=color, label=f"{ph} {b}")
    ax[1][0].set(title="phase seconds", xlabel="trainer step")
    for key in ("logprob_max_abs_diff", "ref_logprob_max_abs_diff", "entropy_max_abs_diff"):
        ax[1][1].semilogy(t, [max(s[key], 1e-12) for s in steps], "-o", label=key)
    ax[1][1].set(title="max |stock - shared|", xlabel="trainer step")
    for row in ax:
        for one in row:
            one.legend(fontsize=7)
    cfg = doc["config"]
    fig.suptitle(f"verl-check {cfg['model']} ({cfg['dtype']}): S = {cfg['ideal_speedup_S']:.2f}; "
                 + ", ".join(f"{ph} {v:.2f}x" for ph, v in cfg["speedup"].items()))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
