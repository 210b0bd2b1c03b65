"""One rank of the multi-rank checkpoint key test (tests/test_checkpoint_keys.py, slow), under
torch.distributed.run on gloo: `python tests/ckpt_keys_worker.py HF_CKPT TP EP PP OUT [dense CP DIVISOR]`. Builds the
tiny Qwen3.5 MoE twice at that layout, with our grouped experts and with megatron's SequentialMLP, and saves
both models' `sharded_layout` to `OUT.rank<r>`; then saves the grouped model with megatron's
`dist_checkpointing` into `OUT.dist` (every rank writes its shards).
`dense CP DIVISOR` (a dense HF checkpoint, Qwen2.5): our model at TP / PP / CP, its vocabulary padded to a
multiple of DIVISOR x TP (`padded_vocab` of the test; 0: not padded), and megatron's local spec on the same
provider (under CP with a parameterless core attention in place of megatron's, which refuses CP: the test's
`stock_local_spec_model`); after the layouts, our model (perturbed, padded rows included) is saved to
`OUT.dist` and loaded into the stock one, whose parameters go to `OUT.rank<r>` too."""

from __future__ import annotations

import json
import sys


def main(hf, tp, ep, pp, out, dense=None):
    import torch
    import torch.distributed as dist

    from ps_bridge.checkpoint import sharded_layout
    from ps_bridge.compat.te_placeholder import import_megatron_bridge

    import_megatron_bridge()
    import ps_bridge.providers.qwen35 as qwen35
    from ps_bridge.tools.runtime import load_model

    if dense is not None:
        return dense_model(hf, tp, pp, out, *dense)
    ours = load_model(hf, tp=tp, ep=ep, pp=pp).model
    orig = qwen35.make_prefix_shared

    def with_sequential_mlp(provider, gdn_backend):
        orig(provider, gdn_backend)
        provider.moe_grouped_gemm = False

    qwen35.make_prefix_shared = with_sequential_mlp
    from transformers import AutoConfig

    from ps_bridge.tools.runtime import load_model_from_hf_config

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


def dense_model(hf, tp, pp, out, cp, divisor):
    import pytest
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from ps_bridge.checkpoint import sharded_layout
    from ps_bridge.tools.runtime import load_model
    from test_checkpoint_keys import padded_vocab, stock_local_spec_model  # (tests/ is the script's directory)

    with pytest.MonkeyPatch.context() as monkeypatch:
        if divisor:
            padded_vocab(monkeypatch, divisor)
        loaded = load_model(hf, tp=tp, pp=pp, cp=cp)
    ours = loaded.model
    stock = stock_local_spec_model(loaded.provider)
    result = {"ours": sharded_layout(ours.sharded_state_dict()), "stock": sharded_layout(stock.sharded_state_dict()),
              "padded_vocab_size": loaded.padded_vocab_size}
    embedding = getattr(ours, "embedding", None)
    result["embedding"] = None if embedding is None else embedding.word_embeddings.weight.detach().clone()
    torch.manual_seed(1)  # the same on every rank: TP-replicated parameters (norms) stay one value
    with torch.no_grad():  # values neither model has from its initialisation, in the padded rows too
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for p in stock.parameters():
            p.zero_()
    dist_checkpointing.save(ours.sharded_state_dict(), f"{out}.dist")
    stock.load_state_dict(dist_checkpointing.load(stock.sharded_state_dict(), f"{out}.dist"))
    result["saved"] = {n: p.detach().clone() for n, p in ours.named_parameters()}
    result["loaded"] = {n: p.detach().clone() for n, p in stock.named_parameters()}
    torch.save(result, f"{out}.rank{dist.get_rank()}")
    print("RESULT " + json.dumps({"rank": dist.get_rank()}), flush=True)


if __name__ == "__main__":
    hf, tp, ep, pp, out = sys.argv[1:6]
    dense = tuple(map(int, sys.argv[7:9])) if sys.argv[6:7] == ["dense"] else None
    main(hf, int(tp), int(ep), int(pp), out, dense)
