"""`ps-bridge export` (docs/checkpoints.md): a dist-checkpointed model of our engine -> an HF checkpoint equal
to Megatron-Bridge's export of the same weights, and `ps-bridge logprobs` on it equals the live model.
Qwen2.5 in the default suite, Qwen3.5 dense / MoE slow; one process each."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ps_bridge.tools.cli import main


@pytest.mark.parametrize("family", ["qwen2.5", pytest.param("qwen3.5", marks=pytest.mark.slow),
                                    pytest.param("qwen3.5-moe", marks=pytest.mark.slow)])
def test_export_equals_the_bridge_export_and_logprobs_equal_the_live_model(tmp_path, family):
    from megatron.core import dist_checkpointing

    from ps_bridge.layout import build_layout
    from ps_bridge.rows import PackedRows
    from ps_bridge.tools.runtime import forward_logits, load_model
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples
    from ps_bridge.tools.verl_check.side_by_side import tiny_checkpoint

    hf = str(tmp_path / "hf")
    tiny_checkpoint(hf, family)
    live = load_model(hf)
    with torch.no_grad():  # trained weights: not the HF checkpoint's
        for p in live.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # verl 0.9.1's layout with use_dist_checkpointing=True: model/dist_ckpt, no HF config (save_contents without
    # 'hf_model'): --hf-config names the model the run started from
    ckpt = tmp_path / "global_step_3"
    (ckpt / "model" / "dist_ckpt").mkdir(parents=True)
    dist_checkpointing.save(live.model.sharded_state_dict(), str(ckpt / "model" / "dist_ckpt"))
    out = str(tmp_path / "exported")
    assert main(["export", "--checkpoint", str(ckpt), "--out", out, "--hf-config", hf]) == 0
    exported = load_file(os.path.join(out, "model.safetensors"))
    reference = dict(live.bridge.export_hf_weights([live.model], cpu=True, show_progress=False))
    assert set(exported) == set(reference)
    for name, t in reference.items():
        assert torch.equal(exported[name], t), name
    samples = grpo_like_samples(min(live.vocab_size, 248), num_prompts=2, n=3, prompt_len=(5, 9), response_len=(2, 5), seed=1)
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    assert main(["logprobs", "--hf-path", out, "--batch", str(batch), "--out", str(tmp_path / "lp.json")]) == 0
    got = [torch.tensor(s["logprobs"]) for s in json.loads((tmp_path / "lp.json").read_text())["samples"]]
    layout = build_layout(samples, share=True, vocab_size=live.vocab_size)
    rows = PackedRows.of(layout)
    with torch.no_grad():
        want = rows.responses(rows.logprobs(forward_logits(live, layout)))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g - w.float()).abs().max().item() < 1e-5


def test_export_names_a_missing_shard(tmp_path):
    ckpt = tmp_path / "global_step_1"
    (ckpt / "model" / "dist_ckpt").mkdir(parents=True)
    (ckpt / "model" / "dist_ckpt" / ".metadata").write_bytes(b"not a checkpoint")
    (ckpt / "model" / "huggingface").mkdir()
    (ckpt / "model" / "huggingface" / "config.json").write_text("{}")
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "o")]) == 2
