"""Checkpoints of prefix-shared models: what is saved, and the checks before a load (docs/checkpoints.md).

The model's sharded checkpoint keys are megatron's own (`models/experts.py`, `models/qwen35_specs.py`),
so verl's checkpoint manager saves and loads our engine's models unchanged. What this module adds:

- `sharded_layout`: a model's sharded state dict as the checkpoint sees it (key, kind, global shape,
  offset, fragmentation, replica id of every shard, factories applied), to compare two models' checkpoints;
- `check_checkpoint_files`: every file a checkpoint directory's metadata names is present and as long
  as the metadata says (megatron's `dist_checkpointing` trees and HF safetensors), else
  `CheckpointFileError` naming the file, before megatron or safetensors fail with a message that does not;
- `refuse_inexact_load`: the loads that cannot give back the saved values, refused with the setting
  named (multi-token-prediction weights on one side only; the distributed optimizer's `dp_reshardable`
  format across another parallel layout or parameter order).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Dict, Iterable, List, Optional, Tuple

# ---- what a model saves -----------------------------------------------------------------------


def sharded_layout(sharded_state_dict: dict) -> List[Tuple]:
    """Sorted `(key, kind, global_shape, global_offset, axis_fragmentations, replica_id, dtype)` of every
    shard `sharded_state_dict` saves (`ShardedTensorFactory`s built, as `dist_checkpointing.save` does;
    objects have kind "object" and their shape / offset in the two shape fields)."""
    # imported here: megatron-core is heavy
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    apply_factories(sharded_state_dict)
    rows = []
    for v in nested_values(sharded_state_dict):
        if isinstance(v, ShardedTensor):
            rows.append((v.key, "tensor", tuple(v.global_shape), tuple(v.global_offset),
                         tuple(v.axis_fragmentations), tuple(v.replica_id), str(v.dtype)))
        elif isinstance(v, ShardedObject):
            rows.append((v.key, "object", tuple(v.global_shape), tuple(v.global_offset), (), tuple(v.replica_id), ""))
    return sorted(rows)


def main_replica_shards(layout: Iterable[Tuple]) -> List[Tuple[str, Tuple]]:
    """(key, global offset) of the shards this rank writes (replica id all zeros)."""
    return [(row[0], row[3]) for row in layout if not any(row[5])]


# ---- files of a checkpoint ----------------------------------------------------------------------


class CheckpointFileError(RuntimeError):
    """A checkpoint file named by its metadata is missing or shorter than the metadata says."""


DAMAGED_FIX = "the checkpoint is incomplete (an interrupted save or copy): save it again or resume from an earlier one"


def _dist_ckpt_files(ckpt_dir: str) -> Dict[str, int]:
    """{file: bytes it must hold at least} of a torch_dist `dist_checkpointing` directory."""
    # imported here: torch is heavy (the checkpoint file checks import without it)
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(ckpt_dir).read_metadata()
    except Exception as err:  # noqa: BLE001 - any unreadable metadata is reported by its file name
        raise CheckpointFileError(
            f"checkpoint metadata {os.path.join(ckpt_dir, '.metadata')} is missing or unreadable ({err}); {DAMAGED_FIX}"
        ) from None
    need: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    return need


def _safetensors_files(hf_dir: str) -> Dict[str, int]:
    """{file: bytes} of an HF safetensors directory (the index's files, each header's data end)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
        if not names:
            raise CheckpointFileError(f"checkpoint file {os.path.join(hf_dir, 'model.safetensors')} is missing (no "
                                      f".safetensors file in the directory: the checkpoint's HF weights); {DAMAGED_FIX}")
    need = {}
    for name in names:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            need[name] = 1  # reported as missing below
            continue
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFileError(f"checkpoint file {path} is truncated ({len(head)} bytes); {DAMAGED_FIX}")
            (size,) = struct.unpack("<Q", head)
            try:
                header = json.loads(f.read(size))
            except ValueError:
                raise CheckpointFileError(f"checkpoint file {path} is truncated (its header is cut); {DAMAGED_FIX}") from None
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        need[name] = 8 + size + max(ends, default=0)
    return need


def _check_sizes(directory: str, need: Dict[str, int]) -> None:
    for name, size in sorted(need.items()):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointFileError(f"checkpoint file {path} is missing (named by the checkpoint's metadata); {DAMAGED_FIX}")
        have = os.path.getsize(path)
        if have < size:
            raise CheckpointFileError(
                f"checkpoint file {path} is truncated: {have} bytes, its metadata needs {size}; {DAMAGED_FIX}")


def check_dist_checkpoint_files(ckpt_dir: str) -> None:
    _check_sizes(ckpt_dir, _dist_ckpt_files(ckpt_dir))


def check_hf_checkpoint_files(hf_dir: str) -> None:
    _check_sizes(hf_dir, _safetensors_files(hf_dir))


# verl's checkpoint layouts: 0.9.1's v2 (a tree per content) and 0.8.0's (one dist_ckpt tree holding the
# model, when dist-checkpointed, the optimizer, scheduler and RNG states; the HF weights beside it)
_TREE_PATHS = {
    "v2": {"model": ("model", "dist_ckpt"), "optimizer": ("optimizer", "dist_ckpt"),
           "extra": ("extra", "dist_ckpt"), "huggingface": ("model", "huggingface")},
    "v1": {"model": ("dist_ckpt",), "optimizer": ("dist_ckpt",), "extra": ("dist_ckpt",),
           "huggingface": ("huggingface",)},
}


def verl_checkpoint_layout(local_path: str) -> str:
    """"v1" for verl 0.8.0's layout (`dist_ckpt/`, `huggingface/`), else "v2" (verl 0.9.1's)."""
    v2 = any(os.path.isdir(os.path.join(local_path, d)) for d in ("model", "optimizer", "extra"))
    return "v1" if not v2 and os.path.isdir(os.path.join(local_path, "dist_ckpt")) else "v2"


def verl_tree_path(local_path: str, tree: str) -> str:
    """Where tree `model` / `optimizer` / `extra` / `huggingface` of the checkpoint at `local_path` lies."""
    return os.path.join(local_path, *_TREE_PATHS[verl_checkpoint_layout(local_path)][tree])


def verl_checkpoint_trees(local_path: str) -> Dict[str, str]:
    """verl's checkpoint trees that exist under `local_path` (either layout): name -> directory."""
    trees = {t: verl_tree_path(local_path, t) for t in ("model", "optimizer", "extra", "huggingface")}
    return {k: v for k, v in trees.items() if os.path.isdir(v)}


def check_checkpoint_files(local_path: str, trees: Optional[Iterable[str]] = None) -> None:
    """Every file of the named verl checkpoint trees (all present ones by default) is there and whole."""
    present = verl_checkpoint_trees(local_path)
    if trees is None:  # verl writes model/huggingface (config, tokenizer) with dist-checkpointed weights too,
        # and an empty model/dist_ckpt with HF weights
        trees = [t for t in present if any(
            t != "huggingface" or n.endswith((".safetensors", ".safetensors.index.json")) for n in os.listdir(present[t]))]
    checked = set()
    for name in trees:
        if name not in present:
            raise CheckpointFileError(f"checkpoint directory {verl_tree_path(local_path, name)} is missing; {DAMAGED_FIX}")
        if present[name] in checked:  # (verl 0.8.0: one tree for model, optimizer and extra)
            continue
        checked.add(present[name])
        if name == "huggingface":
            check_hf_checkpoint_files(present[name])
        else:
            check_dist_checkpoint_files(present[name])


# ---- loads that cannot be exact ------------------------------------------------------------------


class InexactLoadError(ValueError):
    """A checkpoint load that would not give back the saved values."""


def dist_checkpoint_keys(ckpt_dir: str) -> List[str]:
    # imported here: torch is heavy (the checkpoint file checks import without it)
    import torch.distributed.checkpoint as dcp

    return sorted(dcp.FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata)


def refuse_mtp_mismatch(ckpt_dirs: Iterable[str], model_has_mtp: bool) -> None:
    """Multi-token-prediction weights in the checkpoint but not in the model (or the reverse) are refused:
    the distributed optimizer's flat buffers would hold other parameters at the saved offsets."""
    for d in sorted(set(ckpt_dirs)):
        if not os.path.exists(os.path.join(d, ".metadata")):
            continue
        saved = any(".mtp." in f".{k}" for k in dist_checkpoint_keys(d))
        if saved != model_has_mtp:
            where = "the checkpoint has" if saved else "the model has, the checkpoint has not,"
            raise InexactLoadError(
                f"{d}: {where} multi-token-prediction (MTP) weights. Prefix sharing never builds the MTP layer; "
                "save and resume both with mtp_num_layers=None (verl: "
                "actor_rollout_ref.actor.megatron.override_transformer_config.mtp_num_layers=null), "
                "or export the weights (`ps-bridge export`) and start from the HF checkpoint"
            )


# ---- the distributed optimizer's dp_reshardable format -----------------------------------------------

LAYOUT_RECORD = "ps_bridge_layout.json"  # beside the checkpoint's optimizer tree (optimizer/), written by our engine
FULLY_RESHARDABLE_FIX = (
    "resume at the saved layout with the same model, or save the checkpoint with "
    "actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable=True (megatron's fully reshardable "
    "optimizer format, which reshards) and resume from that one")


def parallel_layout(model_chunks) -> Dict[str, int]:
    """The parallel sizes a `dp_reshardable` optimizer checkpoint depends on (all but data parallelism)."""
    # imported here: megatron-core is heavy
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size(), "vpp": len(model_chunks)}


def layout_record_path(local_path: str) -> str:
    """The layout record beside the checkpoint's optimizer tree: `optimizer/` (verl 0.9.1), the step's
    directory (verl 0.8.0)."""
    return os.path.join(os.path.dirname(verl_tree_path(local_path, "optimizer")), LAYOUT_RECORD)


def _domain() -> str:
    """This rank's model-parallel position: ranks that differ only in data / context parallelism hold the
    same parameters in the same buffers."""
    # imported here: megatron-core is heavy
    from megatron.core import parallel_state as ps

    return (f"tp{ps.get_tensor_model_parallel_rank()}.pp{ps.get_pipeline_model_parallel_rank()}"
            f".ep{ps.get_expert_model_parallel_rank()}.etp{ps.get_expert_tensor_parallel_rank()}")


def buffer_order(model_chunks) -> str:
    """A digest of where every parameter lies in megatron's DDP buffers (the flat layout `dp_reshardable`
    saves): per model chunk and buffer, each parameter's name, shape, start, end and bucket, in order."""
    rows = []
    for c, chunk in enumerate(model_chunks):
        names = {id(p): n for n, p in chunk.named_parameters()}
        for kind in ("buffers", "expert_parallel_buffers"):
            for b, buf in enumerate(getattr(chunk, kind, None) or []):
                for param, (start, end, bucket) in sorted(buf.param_index_map.items(), key=lambda kv: kv[1]):
                    rows.append((c, kind, b, str(buf.param_dtype), names.get(id(param), "?"),
                                 tuple(param.shape), int(start), int(end), int(bucket)))
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def write_layout_record(local_path: str, model_chunks) -> None:
    """After a save: the parallel layout and every model-parallel position's buffer order, to
    `layout_record_path` (rank 0 writes; every rank must call)."""
    # imported here: torch is heavy (the checkpoint file checks import without it)
    import torch.distributed as dist

    mine = (_domain(), buffer_order(model_chunks))
    gathered = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path = layout_record_path(local_path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"layout": parallel_layout(model_chunks), "buffers": dict(gathered)}, f, indent=1, sort_keys=True)


def optimizer_sharding_type(optimizer_dir: str) -> Optional[str]:
    """The distributed optimizer's checkpoint format a `dist_checkpointing` tree was saved in (its content
    metadata's `distrib_optim_sharding_type`), None without one (the non-distributed optimizer)."""
    # imported here: megatron-core is heavy
    from megatron.core import dist_checkpointing

    if not os.path.isfile(os.path.join(optimizer_dir, ".metadata")):
        return None
    metadata = dist_checkpointing.load_content_metadata(checkpoint_dir=optimizer_dir) or {}
    return metadata.get("distrib_optim_sharding_type")


def refuse_dp_reshardable_change(local_path: str, model_chunks, sharding_type: Optional[str]) -> None:
    """A `dp_reshardable` optimizer checkpoint loads megatron's flat DDP buckets as they were: at another
    parallel layout (other than data parallelism) or another parameter order it would give parameters other
    parameters' state, silently. Refused unless the checkpoint's layout record (written by our engine's save)
    shows the same layout and, at this rank's model-parallel position, the same buffer order."""
    if sharding_type != "dp_reshardable":
        return
    path = layout_record_path(local_path)
    head = (f"{verl_tree_path(local_path, 'optimizer')}: the distributed optimizer's state was saved in megatron's "
            "`dp_reshardable` format (flat DDP buckets), which loads correctly only at the saved parallel layout "
            "and parameter order")
    if not os.path.isfile(path):
        raise InexactLoadError(f"{head}; the checkpoint has no {LAYOUT_RECORD} (not saved by ps-bridge's engine), "
                               f"so neither can be checked. Fix: {FULLY_RESHARDABLE_FIX}")
    with open(path) as f:
        record = json.load(f)
    now = parallel_layout(model_chunks)
    changed = {k: (record["layout"].get(k), v) for k, v in now.items() if record["layout"].get(k) != v}
    if changed:
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(changed.items()))
        raise InexactLoadError(f"{head}; the layout changed ({what}). Fix: {FULLY_RESHARDABLE_FIX}")
    saved = record["buffers"].get(_domain())
    if saved != buffer_order(model_chunks):
        raise InexactLoadError(f"{head}; this model's parameters lie in its buffers in another order than the "
                               f"saved model's (another model, expert module or bucket size). Fix: {FULLY_RESHARDABLE_FIX}")


def refuse_distributed_optimizer_load_without_fused_adam(optimizer) -> None:
    """megatron-core's distributed optimizer loads a checkpoint only on Transformer Engine's or Apex's Adam:
    on its torch-Adam fallback (neither installed, as on our stacks) a fresh optimizer cannot describe its
    state (megatron/core/optimizer/distrib_optimizer.py `state_dict`: `assert len(steps) == 1` over no state)
    and the load copies into torch Adam's `step` too (`_set_main_param_and_optimizer_states`). Refused with
    the setting named, before megatron fails on an assertion."""
    try:
        # imported here: megatron-core is heavy
        from megatron.core.optimizer import distrib_optimizer
    except ImportError:
        return
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    if any(isinstance(o, distrib_optimizer.DistributedOptimizer) for o in chained):
        raise InexactLoadError(
            "the distributed optimizer's checkpoint cannot be loaded here: megatron-core loads it only with "
            "Transformer Engine's or Apex's Adam, and neither is installed (its torch-Adam fallback fails on a "
            "load). Install transformer_engine, or train with "
            "actor_rollout_ref.actor.megatron.use_distributed_optimizer=False (its checkpoints load either way), "
            "or resume without the optimizer (actor_rollout_ref.actor.checkpoint.load_contents=['model','extra']: "
            "its state restarts, not an exact resume)")
