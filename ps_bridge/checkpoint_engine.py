"""verl 0.9.1's checkpoint save / load on our engine (docs/checkpoints.md): `CheckpointEngineMixin`.

The engine's checkpoints are verl's own (`MegatronCheckpointManager`, its v2 layout), written from the
model's sharded state dict, whose keys are megatron's stock ones (`ps_bridge/checkpoint.py`). This mixin
adds, around verl's load only:
- the checks of `ps_bridge.checkpoint` first: a missing or truncated file is named
  (`CheckpointFileError`), multi-token-prediction weights on one side only and the distributed optimizer's
  `dp_reshardable` state at another layout or parameter order are refused (`InexactLoadError`); after a
  save with the distributed optimizer, the layout record that last check reads;
- a fix of verl's manager for `use_dist_checkpointing=True`: it builds the model's sharded state dict once
  and hands it to the model load and then to the optimizer load, but megatron's `dist_checkpointing.load`
  replaces the sharded tensors in it by the loaded ones, so the optimizer's map from parameter to
  sharded tensor finds none ("Param id 0 does not match any model sharded param"); the optimizer gets a
  fresh one (the stock engine has the same failure; verl's own code is left unchanged);
- verl's default model save (HF safetensors through the bridge, `use_dist_checkpointing=False`) without
  NVIDIA modelopt: Megatron-Bridge 0.6.2's `save_hf_weights` imports modelopt only to ask whether the
  model is modelopt-quantized (megatron/bridge/models/conversion/auto_bridge.py:1127, unconditionally);
  where modelopt is not installed no model can be, so the answer is "no" (`modelopt_absent_means_unquantized`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

from ps_bridge.checkpoint import (
    check_checkpoint_files, optimizer_sharding_type, refuse_distributed_optimizer_load_without_fused_adam,
    refuse_dp_reshardable_change, refuse_mtp_mismatch, verl_checkpoint_trees, write_layout_record,
)
from ps_bridge.compat import verl as verl_compat


def _fresh_model_state_for_optimizer(manager) -> None:
    build = verl_compat.optimizer_state_dict_builder(type(manager))
    if build is None:  # a manager without that step (compat/verl.py): left as is
        return

    def _build_optimizer_state_dict(self, model_sharded_state_dict, metadata, is_loading=False, *args, **kwargs):
        if is_loading and self.should_load_dist_ckpt_model:
            model_sharded_state_dict = self._build_model_sharded_state_dict(metadata)
        return build(self, model_sharded_state_dict, metadata, is_loading, *args, **kwargs)

    manager._build_optimizer_state_dict = types.MethodType(_build_optimizer_state_dict, manager)


@contextlib.contextmanager
def modelopt_absent_means_unquantized():
    """Inside: `modelopt.torch.quantization.utils.is_quantized` answers False when modelopt is not
    installed (a model is modelopt-quantized only by modelopt); nothing changes where it is."""
    if importlib.util.find_spec("modelopt") is not None:
        yield
        return
    names = ("modelopt", "modelopt.torch", "modelopt.torch.quantization", "modelopt.torch.quantization.utils")
    modules = {n: types.ModuleType(n) for n in names}
    modules["modelopt.torch.quantization.utils"].is_quantized = lambda model: False
    for parent, child in zip(names, names[1:]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n in names:
            if sys.modules.get(n) is modules[n]:
                del sys.modules[n]


def _hf_save_without_modelopt(manager) -> None:
    bridge = getattr(manager, "bridge", None)
    if bridge is None or not hasattr(bridge, "save_hf_weights"):
        return
    save = bridge.save_hf_weights

    def save_hf_weights(*args, **kwargs):
        with modelopt_absent_means_unquantized():
            return save(*args, **kwargs)

    bridge.save_hf_weights = save_hf_weights


def fix_checkpoint_manager(manager) -> None:
    """The fixes of verl 0.9.1's checkpoint manager above (the stock engine's too, in the tests)."""
    _fresh_model_state_for_optimizer(manager)
    _hf_save_without_modelopt(manager)


def _record_layout_on_save(manager) -> None:
    """After each save with the distributed optimizer: the layout record `refuse_dp_reshardable_change` reads."""
    save = manager.save_checkpoint

    def save_checkpoint(local_path, *args, **kwargs):
        result = save(local_path, *args, **kwargs)
        if getattr(manager, "use_distributed_optimizer", False) and getattr(manager, "should_save_optimizer", True):
            write_layout_record(local_path, manager.model)
        return result

    manager.save_checkpoint = save_checkpoint


def _model_has_mtp(engine) -> bool:
    return any(getattr(m, "mtp", None) is not None for m in engine.module)


class CheckpointEngineMixin:
    """Mixed into `PrefixSharedMegatronEngine` before verl's engine class."""

    def initialize(self):
        result = super().initialize()
        manager = getattr(self, "checkpoint_mananager", None)  # verl's spelling
        if manager is not None:
            fix_checkpoint_manager(manager)
            _record_layout_on_save(manager)
        return result

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        manager = self.checkpoint_mananager
        if local_path is not None:
            trees = []
            if "model" in manager.checkpoint_load_contents:
                trees.append("model" if manager.use_dist_checkpointing else "huggingface")
            if manager.should_load_optimizer:
                trees.append("optimizer")
            if manager.should_load_extra:
                trees.append("extra")
            check_checkpoint_files(local_path, trees)
            present = verl_checkpoint_trees(local_path)
            refuse_mtp_mismatch([present[t] for t in ("model", "optimizer") if t in present and t in trees],
                                _model_has_mtp(self))
            if manager.should_load_optimizer:
                refuse_dp_reshardable_change(local_path, self.module, optimizer_sharding_type(present["optimizer"]))
                refuse_distributed_optimizer_load_without_fused_adam(self.optimizer)
        return super().load_checkpoint(local_path, hdfs_path=hdfs_path, del_local_after_load=del_local_after_load,
                                       **kwargs)
