"""One rank of the multi-rank checkpoint key test (tests/test_checkpoint_keys.py, slow), under
torch.distributed.run on gloo: `python tests/ckpt_keys_worker.py HF_CKPT TP EP PP OUT`. Builds the tiny
Qwen3.5 MoE twice at that layout, with our grouped experts and with megatron's SequentialMLP, and saves
both models' `sharded_layout` to `OUT.rank<r>`; then saves the grouped model with megatron's
`dist_checkpointing` into `OUT.dist` (every rank writes its shards)."""

from __future__ import annotations

import json
import sys


def main(hf, tp, ep, pp, out):
    import torch
    import torch.distributed as dist

    from ps_bridge.checkpoint import sharded_layout
    from ps_bridge.compat.te_placeholder import import_megatron_bridge

    import_megatron_bridge()
    import ps_bridge.providers.qwen35 as qwen35
    from ps_bridge.runtime import load_model

    ours = load_model(hf, tp=tp, ep=ep, pp=pp).model
    orig = qwen35.make_prefix_shared

    def with_sequential_mlp(provider, gdn_backend):
        orig(provider, gdn_backend)
        provider.moe_grouped_gemm = False

    qwen35.make_prefix_shared = with_sequential_mlp
    from transformers import AutoConfig

    from ps_bridge.runtime import load_model_from_hf_config

    # megatron's random initial weights: only the layout is compared (Megatron-Bridge 0.5.0 could not load
    # Qwen3.5 MoE's HF experts into SequentialMLP)
    stock = load_model_from_hf_config(AutoConfig.from_pretrained(hf), tp=tp, ep=ep, pp=pp).model
    qwen35.make_prefix_shared = orig
    rank = dist.get_rank()
    torch.save({"ours": sharded_layout(ours.sharded_state_dict()),
                "stock": sharded_layout(stock.sharded_state_dict())}, f"{out}.rank{rank}")
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(ours.sharded_state_dict(), f"{out}.dist")  # raises on overlapping or missing shards
    print("RESULT " + json.dumps({"rank": rank}), flush=True)


if __name__ == "__main__":
    hf, tp, ep, pp, out = sys.argv[1:6]
    main(hf, int(tp), int(ep), int(pp), out)
