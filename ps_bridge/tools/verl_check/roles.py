"""One role's engine (actor or ref) driven as verl's `TrainingWorker` drives it, and the engines of
each kind verl-check compares."""

from __future__ import annotations

import torch

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.tools.verl_check.config import CheckSettings
from ps_bridge.tools.verl_check.model import stock_kind


class Role:
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
            # imported here: verl is optional (requirements-verl.txt)
            from verl.utils import tensordict_utils as tu

            out = inner(data, loss_function, forward_only=forward_only)
            self.micro_batches += int(tu.get_non_tensor_data(data, key="num_micro_batch", default=0))
            return out

        engine.forward_backward_batch = counting

    def _defaults(self, td, infer: bool) -> None:
        # imported here: verl is optional (requirements-verl.txt)
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
        """TrainingWorker.infer_batch: the model outputs (log_probs, entropy) as nested rows, on the CPU
        (the worker returns `.cpu()` outputs: the trainer's batch, and so the update's, lives on the
        CPU, and each engine copies its micro-batches to the device)."""
        self._defaults(td, infer=True)
        with self.engine.eval_mode():
            output = self.engine.infer_batch(td, loss_function=None)
        return {k: v.cpu() if torch.is_tensor(v) else v for k, v in output["model_output"].items()}

    def train(self, td) -> dict:
        """TrainingWorker.train_mini_batch: per mini-batch loss (summed over its micro-batches, as the
        worker's `_postprocess_output`), grad norm, and the loss function's KL metric."""
        # imported here: tensordict comes with verl (optional); verl is optional (requirements-verl.txt)
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
                    metrics["kl_loss"].append(metric_value(kl))
        return metrics


def build_role_engines(kind: str, ckpt: str, settings: CheckSettings, actor_cfg, ref_cfg, rollout):
    """(actor engine, ref engine) of `kind` ('stock', 'shared', 'stock-split'), built by verl."""
    # imported here: verl is optional (requirements-verl.txt)
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.verl.engine import PrefixSharedMegatronEngine
    from ps_bridge.tools.verl_check.side_by_side import build_engine, build_stock_engine

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
        if kind == "shared":  # every common prefix once (the prefix tree) unless settings.tree is False
            engine = build_engine(PrefixSharedMegatronEngine, ckpt, **kw)
            engine.prefix_sharing_config = PrefixSharingConfig.from_env(
                enabled=True, backend=shared_backend(settings), tree=settings.tree)
        elif stock_kind(ckpt, settings.baseline) == "verl":
            engine = build_stock_engine(ckpt, **kw)
        else:
            engine = build_engine(PrefixSharedMegatronEngine, ckpt, **kw)
            engine.prefix_sharing_config = PrefixSharingConfig.from_env(enabled=False, backend=shared_backend(settings),
                                                                        cuda_graphs=settings.baseline_graphs)
        return engine

    actor = one(actor_cfg, False, rollout["max_token_len"])
    ref = one(ref_cfg, True, ref_cfg.ppo_max_token_len_per_gpu)
    return actor, ref


def shared_tree(settings: CheckSettings) -> bool:
    """Whether the prefix-shared engine packs prefix trees (`PrefixSharingConfig.tree`)."""
    return PrefixSharingConfig.from_env(enabled=True, tree=settings.tree).tree


def shared_backend(settings: CheckSettings) -> str:
    env = PrefixSharingConfig.from_env(enabled=True).backend
    if env != "torch_ref" or not torch.cuda.is_available() or settings.dtype == "float32":
        return env
    return "auto"


def metric_value(x) -> float:
    """A verl `Metric` (or a list of per-micro-batch ones) aggregated as verl aggregates it."""
    if isinstance(x, list):
        # imported here: verl is optional (requirements-verl.txt)
        from verl.utils.metric.utils import Metric

        return float(Metric.aggregate_dp(x)) if x and isinstance(x[0], Metric) else float(sum(x))
    return float(x.aggregate()) if hasattr(x, "aggregate") else float(x)
