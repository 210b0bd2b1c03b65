"""`ps-bridge logprobs` and `ps-bridge demo`: happy paths and each bad input."""

import json
import subprocess
import sys

import pytest
import torch

from ps_bridge.cli import main
from ps_bridge.tiny_checkpoints import grpo_like_samples, hf_sample_logprobs


def write_batch(path, samples):
    path.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    return str(path)


def test_logprobs_happy_path_shared_and_unshared(tmp_path, qwen2_checkpoint):
    hf_path, hf_model = qwen2_checkpoint
    samples = grpo_like_samples(256, num_prompts=2, n=3, seed=11)
    batch = write_batch(tmp_path / "batch.json", samples)
    outs = {}
    for flag in ([], ["--no-prefix-sharing"]):
        out = tmp_path / f"out{len(flag)}.json"
        assert main(["logprobs", "--hf-path", hf_path, "--batch", batch, "--out", str(out), *flag]) == 0
        outs[bool(flag)] = json.loads(out.read_text())
    shared, unshared = outs[False], outs[True]
    assert shared["prefix_sharing"] is True and unshared["prefix_sharing"] is False
    assert shared["backend"] == "torch_ref"
    assert shared["groups"] == 2 and unshared["groups"] == 6
    assert shared["tokens_unshared"] == unshared["tokens_unshared"] == sum(len(s.prompt) + len(s.response) for s in samples)
    assert shared["tokens_shared"] < unshared["tokens_shared"]
    with torch.no_grad():
        refs = hf_sample_logprobs(hf_model, samples)
    for s, u, ref in zip(shared["samples"], unshared["samples"], refs):
        assert len(s["logprobs"]) == len(ref)
        assert max(abs(a - b) for a, b in zip(s["logprobs"], ref.tolist())) <= 1e-5
        assert max(abs(a - b) for a, b in zip(u["logprobs"], ref.tolist())) <= 1e-5


@pytest.fixture
def good_batch(tmp_path):
    return write_batch(tmp_path / "good.json", grpo_like_samples(256, num_prompts=1, n=2, seed=0))


def run_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("ps-bridge: error: ")
    return err


def test_missing_batch_file(tmp_path, qwen2_checkpoint, capsys):
    err = run_error(capsys, ["logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o.json")])
    assert "batch file not found" in err


def test_missing_checkpoint(tmp_path, good_batch, capsys):
    err = run_error(capsys, ["logprobs", "--hf-path", str(tmp_path / "no_ckpt"), "--batch", good_batch, "--out", str(tmp_path / "o.json")])
    assert "checkpoint directory not found" in err


def test_bad_json(tmp_path, qwen2_checkpoint, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{samples: [")
    err = run_error(capsys, ["logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", str(bad), "--out", str(tmp_path / "o.json")])
    assert "not valid JSON" in err


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"samples": [{"prompt": [], "response": [1]}]}, "prompt is empty"),
        ({"samples": [{"prompt": [1], "response": []}]}, "response is empty"),
        ({"samples": [{"prompt": [1, 256], "response": [2]}]}, "out of the vocabulary"),
        ({"samples": [{"prompt": [1], "response": ["a"]}]}, "list of integer token ids"),
        ({"samples": [{"prompt": [1]}]}, 'must be an object with "prompt" and "response"'),
        ({"items": []}, 'expected an object {"samples"'),
        ({"samples": []}, "no samples"),
    ],
)
def test_bad_batches(tmp_path, qwen2_checkpoint, capsys, payload, message):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(payload))
    err = run_error(capsys, ["logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", str(path), "--out", str(tmp_path / "o.json")])
    assert message in err


def test_unsupported_architecture(tmp_path, good_batch, capsys):
    ckpt = tmp_path / "llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 256}))
    err = run_error(capsys, ["logprobs", "--hf-path", str(ckpt), "--batch", good_batch, "--out", str(tmp_path / "o.json")])
    assert "unsupported architecture LlamaForCausalLM" in err and "Qwen2ForCausalLM" in err


def test_unknown_backend(tmp_path, qwen2_checkpoint, good_batch, capsys):
    err = run_error(capsys, ["logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", good_batch, "--out", str(tmp_path / "o.json"), "--backend", "warp"])
    assert "valid backends" in err


def test_demo_json_in_a_fresh_process():
    """The installed console script runs the main job end to end and reports fp32-level agreement."""
    proc = subprocess.run(
        [sys.executable, "-m", "ps_bridge.cli", "demo", "--json", "--prompts", "2", "--n", "4"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens_shared"] < result["tokens_unshared"]
    assert result["max_logprob_diff_shared_vs_hf"] <= 1e-5
    assert result["max_logprob_diff_shared_vs_unshared"] <= 1e-5
    assert result["max_rel_grad_diff_shared_vs_unshared"] <= 1e-5


def test_qwen35_vl_checkpoint_through_the_cli(tmp_path, capsys):
    """An official-style Qwen3.5 ConditionalGeneration checkpoint: text batches give HF's log-probs,
    a batch with an image placeholder token is refused with a one-line error."""
    from ps_bridge.tiny_checkpoints import TINY_BUILDERS

    ckpt = tmp_path / "q35vl"
    hf_model = TINY_BUILDERS["qwen3.5-vl"](str(ckpt))
    image_token = hf_model.config.image_token_id
    text = [{"prompt": [1, 2, 3, 4], "response": [5, 6]}, {"prompt": [1, 2, 3, 4], "response": [7]}]
    batch = tmp_path / "text.json"
    batch.write_text(json.dumps({"samples": text}))
    out = tmp_path / "out.json"
    assert main(["logprobs", "--hf-path", str(ckpt), "--batch", str(batch), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["groups"] == 1 and got["tokens_shared"] == 7
    with torch.no_grad():
        for s, row in zip(text, got["samples"]):
            ids = torch.tensor([s["prompt"] + s["response"]])
            lp = torch.log_softmax(hf_model(input_ids=ids).logits[0].float(), -1)
            P = len(s["prompt"])
            ref = lp[P - 1 : -1].gather(1, ids[0, P:, None]).squeeze(1)
            assert max(abs(a - b) for a, b in zip(row["logprobs"], ref.tolist())) <= 1e-5
    capsys.readouterr()
    image = tmp_path / "image.json"
    image.write_text(json.dumps({"samples": [{"prompt": [1, image_token, 3], "response": [5]}]}))
    err = run_error(capsys, ["logprobs", "--hf-path", str(ckpt), "--batch", str(image), "--out", str(out)])
    assert "text-only batches" in err
