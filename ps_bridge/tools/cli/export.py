"""`ps-bridge export`: a verl checkpoint of our engine with dist-checkpointed weights
(`model/dist_ckpt/`, `use_dist_checkpointing=True`) -> an HF checkpoint, through Megatron-Bridge's own
export of our model (docs/checkpoints.md). verl's `model_merger` cannot do Qwen3.5. One process (TP =
PP = 1: megatron's dist checkpointing reshards on load)."""

from __future__ import annotations

import os
import shutil

from ps_bridge.checkpoint import (CheckpointFileError, InexactLoadError, check_checkpoint_files, refuse_mtp_mismatch,
                                  verl_tree_path)
from ps_bridge.tools.cli.errors import UsageError

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def add_parser(sub) -> None:
    ex = sub.add_parser("export", help="HF checkpoint from a verl checkpoint of our engine (model/dist_ckpt)")
    ex.add_argument("--checkpoint", required=True, help="verl checkpoint directory (global_step_N)")
    ex.add_argument("--out", required=True, help="output HF checkpoint directory")
    ex.add_argument("--hf-config", default=None,
                    help="HF directory with config.json and tokenizer: the model the run started from "
                         "(default: CHECKPOINT/model/huggingface, where verl saved them)")
    ex.set_defaults(func=run_export)


def export_checkpoint(checkpoint: str, out: str, hf_config_dir: str | None = None) -> str:
    # imported here: torch is heavy (not loaded for argument parsing); safetensors comes with transformers (heavy); transformers is heavy
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    # verl 0.9.1: model/dist_ckpt, model/huggingface; verl 0.8.0: dist_ckpt (with the optimizer), huggingface
    dist_dir = verl_tree_path(checkpoint, "model")
    hf_dir = hf_config_dir or verl_tree_path(checkpoint, "huggingface")
    if not os.path.isfile(os.path.join(dist_dir, ".metadata")):
        if os.path.isdir(hf_dir) and any(n.endswith(".safetensors") for n in os.listdir(hf_dir)):
            raise UsageError(f"{checkpoint} holds HF weights already ({hf_dir}): use that directory directly")
        raise UsageError(f"no dist-checkpointed model in {dist_dir} (saved with use_dist_checkpointing=True?)")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise UsageError(
            f"no config.json in {hf_dir}: pass --hf-config with the HF model directory the run started from "
            "(actor_rollout_ref.model.path; with use_dist_checkpointing=True verl saves the HF config and tokenizer "
            "only when actor_rollout_ref.actor.checkpoint.save_contents includes 'hf_model')")
    try:
        check_checkpoint_files(checkpoint, ["model"])
        refuse_mtp_mismatch([dist_dir], model_has_mtp=False)
    except (CheckpointFileError, InexactLoadError) as err:
        raise UsageError(str(err)) from None
    # imported here: megatron-core is heavy; torch is heavy
    from megatron.core import dist_checkpointing

    # imported here: ps_bridge.tools.runtime imports torch, which is heavy (not loaded for argument parsing)
    from ps_bridge.tools.runtime import load_model_from_hf_config

    loaded = load_model_from_hf_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    model = loaded.model
    sharded = model.sharded_state_dict()
    loaded_state = dist_checkpointing.load(sharded, dist_dir)
    # the model's entries only: verl's saves add their common state (`content_metadata`) to what a load returns
    model.load_state_dict({k: v for k, v in loaded_state.items() if k in sharded})
    tensors = {name: t.contiguous() for name, t in
               loaded.bridge.export_hf_weights([model], cpu=True, show_progress=False)}
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy(os.path.join(hf_dir, name), os.path.join(out, name))
    return out


def run_export(args) -> int:
    out = export_checkpoint(args.checkpoint, args.out, args.hf_config)
    print(f"wrote {out}")
    return 0
