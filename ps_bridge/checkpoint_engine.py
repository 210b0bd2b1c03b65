"""verl 0.9.1's checkpoint save / load on our engine (docs/checkpoints.md): `CheckpointEngineMixin`.

The engine's checkpoints are verl's own (`MegatronCheckpointManager`, its v2 layout), written from the
model's sharded state dict, whose keys are megatron's stock ones (`ps_bridge/checkpoint.py`). This mixin
adds, around verl's load only:
- the checks of `ps_bridge.checkpoint` first: a missing or truncated file is named
  (`CheckpointFileError`), multi-token-prediction weights on one side only are refused (`InexactLoadError`);
- a fix of verl's manager for `use_dist_checkpointing=True`: it builds the model's sharded state dict once
  and hands it to the model load and then to the optimizer load, but megatron's `dist_checkpointing.load`
  replaces the sharded tensors in it by the loaded ones, so the optimizer's map from parameter to
  sharded tensor finds none ("Param id 0 does not match any model sharded param"); the optimizer gets a
  fresh one (the stock engine has the same failure; verl's own code is left unchanged).
"""

from __future__ import annotations

import types


def _fresh_model_state_for_optimizer(manager) -> None:
    build = getattr(type(manager), "_build_optimizer_state_dict", None)
    if build is None:  # verl 0.8.0's manager (its older checkpoint layout) has no such step: left as is
        return

    def _build_optimizer_state_dict(self, model_sharded_state_dict, metadata, is_loading=False, *args, **kwargs):
        if is_loading and self.should_load_dist_ckpt_model:
            model_sharded_state_dict = self._build_model_sharded_state_dict(metadata)
        return build(self, model_sharded_state_dict, metadata, is_loading, *args, **kwargs)

    manager._build_optimizer_state_dict = types.MethodType(_build_optimizer_state_dict, manager)


def _model_has_mtp(engine) -> bool:
    return any(getattr(m, "mtp", None) is not None for m in engine.module)


class CheckpointEngineMixin:
    """Mixed into `PrefixSharedMegatronEngine` before verl's engine class."""

    def initialize(self):
        result = super().initialize()
        manager = getattr(self, "checkpoint_mananager", None)  # verl's spelling
        if manager is not None:
            _fresh_model_state_for_optimizer(manager)
        return result

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        from ps_bridge.checkpoint import check_checkpoint_files, refuse_mtp_mismatch, verl_checkpoint_trees

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
        return super().load_checkpoint(local_path, hdfs_path=hdfs_path, del_local_after_load=del_local_after_load,
                                       **kwargs)
