"""`ps-bridge logprobs` and `ps-bridge demo`: happy paths and each bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ps_bridge.tools.cli import main
from ps_bridge.tools.tiny_checkpoints import grpo_like_samples, hf_sample_logprobs


def write_batch(path, samples):
    path.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    return str(path)


@pytest.mark.core
def test_logprobs_happy_path_shared_and_unshared(tmp_path, qwen2_checkpoint):
    hf_path, hf_model = qwen2_checkpoint
    samples = grpo_like_samples(256, num_prompts=2, n=3, seed=11)
    batch = write_batch(tmp_path / "batch.json", samples)
    outs = {}
    for flag in ([], ["--no-prefix-sharing"]):
        out = tmp_path / f"out{len(flag)}.json"
        assert main(["logprobs", "--hf-path", hf_path, "--batch", batch, "--out", str(out), *flag]) == 0
        outs[bool(flag)] = json.loads(out.read_text())
    # a command run in a process that is no torchrun worker leaves the process group in place for its
    # owner (`groups.close_parallel` destroys only what it created in a torchrun worker)
    assert torch.distributed.is_initialized()
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


def test_logprobs_tree_reports_trie_tokens(tmp_path, qwen2_checkpoint):
    from tree_cases import distinct_prefixes, tree_samples

    hf_path, hf_model = qwen2_checkpoint
    samples = tree_samples(2)
    out = tmp_path / "tree.json"
    argv = ["logprobs", "--hf-path", hf_path, "--batch", write_batch(tmp_path / "b.json", samples), "--out", str(out)]
    assert main(argv + ["--tree", "--tree-min-shared", "0"]) == 0
    got = json.loads(out.read_text())
    assert got["tree"] is True and got["tree_depth"] >= 2
    assert got["tokens_shared"] == len(distinct_prefixes(samples))  # the trie's tokens (no padding here)
    with torch.no_grad():
        refs = hf_sample_logprobs(hf_model, samples)
    for s, ref in zip(got["samples"], refs):
        assert max(abs(a - b) for a, b in zip(s["logprobs"], ref.tolist())) <= 2e-5


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
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "vocab_size": 256}))
    err = run_error(capsys, ["logprobs", "--hf-path", str(ckpt), "--batch", good_batch, "--out", str(tmp_path / "o.json")])
    assert "unsupported architecture GPTNeoXForCausalLM" in err and "Qwen2ForCausalLM" in err


def test_unknown_backend(tmp_path, qwen2_checkpoint, good_batch, capsys):
    err = run_error(capsys, ["logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", good_batch, "--out", str(tmp_path / "o.json"), "--backend", "warp"])
    assert "valid backends" in err


def run_cli(*argv):
    """`python -m ps_bridge.tools.cli ARGV` in a fresh process (the heavy imports happen in it)."""
    return subprocess.run([sys.executable, "-m", "ps_bridge.tools.cli", *argv], capture_output=True, text=True, timeout=600)


def noisy_lines(proc):
    """Lines of stdout+stderr that look like a traceback or a warning."""
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "Traceback" in line or "warning" in line.lower()]


@pytest.mark.core
def test_demo_json_in_a_fresh_process():
    """`python -m ps_bridge.tools.cli demo` runs the main job end to end, reports fp32-level agreement, and
    prints no traceback or third-party warning (nor our INFO lines) without -v."""
    proc = run_cli("demo", "--json", "--prompts", "2", "--n", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert noisy_lines(proc) == [], proc.stderr[-3000:]
    assert "[PS]" not in proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens_shared"] < result["tokens_unshared"]
    assert result["max_logprob_diff_shared_vs_hf"] <= 1e-5
    assert result["max_logprob_diff_shared_vs_unshared"] <= 1e-5
    assert result["max_rel_grad_diff_shared_vs_unshared"] <= 1e-5


@pytest.mark.core
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_logprobs_in_a_fresh_process_quiet_unless_verbose(tmp_path, qwen2_checkpoint, verbose):
    """`ps-bridge logprobs` on a tiny checkpoint: no traceback or warning line without -v; with -v
    the [PS] log lines (and the third-party notices) are shown."""
    batch = write_batch(tmp_path / "batch.json", grpo_like_samples(256, num_prompts=1, n=2, seed=3))
    out = tmp_path / "out.json"
    proc = run_cli(*(["-v"] if verbose else []), "logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", batch,
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(out.read_text())["samples"]) == 2
    text = proc.stdout + proc.stderr
    if verbose:
        assert "[PS][prepare]" in text
    else:
        assert noisy_lines(proc) == [], proc.stderr[-3000:]
        assert "[PS]" not in text


def test_quiet_third_party_keeps_our_warnings(monkeypatch):
    """Silenced: a third-party import notice (warning filter by module) and a megatron logger's
    warning; kept: our logger's warnings and a warning raised in our own modules."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    from ps_bridge.compat import quiet

    hf_verbosity, hf_bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    monkeypatch.setattr(logging.getLogger("ps_bridge"), "propagate", True)
    for name in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).filters)) for name in quiet._QUIET_LOGGERS}
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet.quiet_third_party(verbose=False)
            quiet.quiet_third_party(verbose=False)  # idempotent
            warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                                   "backends.py", 34, module="megatron.core.models.backends")
            warnings.warn_explicit("ours", UserWarning, "runtime.py", 1, module="ps_bridge.tools.runtime")
            logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED")
            logging.getLogger("megatron.bridge.utils.import_utils").info("Import of X failed with: Traceback")
            logging.getLogger("ps_bridge").warning("our warning")
            logging.getLogger("megatron.core").error("a third-party error")
    finally:
        logging.getLogger().removeHandler(handler)
        for name, (level, filters) in saved.items():
            logging.getLogger(name).setLevel(level)
            logging.getLogger(name).filters[:] = filters
        hf_logging.set_verbosity(hf_verbosity)
        if hf_bars:
            hf_logging.enable_progress_bar()
    assert [str(w.message) for w in caught] == ["ours"]
    assert [r.getMessage() for r in records] == ["our warning", "a third-party error"]
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"


@pytest.mark.slow
def test_demo_under_torchrun_is_quiet_on_every_rank():
    """`torchrun --nproc-per-node 2 -m ps_bridge.tools.cli demo --tp 2`: no rank prints a traceback or a
    warning (torchrun's own OMP_NUM_THREADS notice is avoided by setting it)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from parallel_cases import torchrun

    proc = torchrun(2, ["-m", "ps_bridge.tools.cli", "demo", "--tp", "2", "--prompts", "2", "--responses", "3"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert noisy_lines(proc) == [], proc.stderr[-4000:]
    assert proc.stdout.count("ps-bridge demo: prefix-shared vs unshared") == 1  # rank 0's table only


def test_verbose_flag_is_seen_before_the_command():
    from ps_bridge.tools.cli import verbose_requested

    assert verbose_requested(["-v", "demo"]) and verbose_requested(["--verbose", "logprobs", "--out", "x"])
    assert not verbose_requested(["demo", "-v"]) and not verbose_requested([])


def test_qwen35_vl_checkpoint_through_the_cli(tmp_path, capsys):
    """An official-style Qwen3.5 ConditionalGeneration checkpoint: text batches give HF's log-probs,
    an image placeholder token without an image is refused with a one-line error naming the sample. Skipped where the VL
    model is refused (Megatron-Bridge < 0.6.0)."""
    from qwen35_helpers import skip_where_vl_refused
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    skip_where_vl_refused()

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
    image.write_text(json.dumps({"samples": [{"prompt": [1, 2], "response": [5]}, {"prompt": [1, image_token, 3], "response": [5]}]}))
    err = run_error(capsys, ["logprobs", "--hf-path", str(ckpt), "--batch", str(image), "--out", str(out)])
    assert "sample 1: 1 image placeholder run(s) (token id 250) for 0 image(s)" in err and "Traceback" not in err


def test_qwen35_vl_image_prompts_through_the_cli(tmp_path, capsys):
    """Image files in the batch: the checkpoint's image processor gives their pixels, the CLI's
    prefix-shared log-probs (two prompts of equal tokens and different images, two responses each)
    equal transformers'; a sample whose placeholders do not match its images is refused naming it."""
    import numpy as np
    from PIL import Image

    from qwen35_helpers import skip_where_vl_refused
    from ps_bridge.images import SampleImage, attach_images
    from ps_bridge.layout import Sample
    from ps_bridge.tools.image_files import image_processor
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS, hf_sample_logprobs

    skip_where_vl_refused()
    ckpt = tmp_path / "q35vl"
    hf_model = TINY_BUILDERS["qwen3.5-vl"](str(ckpt))
    cfg = hf_model.config
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png"):  # 16 x 24 pixels: a 4 x 6 patch grid, 6 placeholders after the 2 x 2 merge
        Image.fromarray((rng.random((16, 24, 3)) * 255).astype("uint8")).save(tmp_path / name)
    prompt = [1, 2, cfg.vision_start_token_id] + [cfg.image_token_id] * 6 + [cfg.vision_end_token_id, 7]
    batch = {"samples": [{"prompt": prompt, "response": r, "images": [f]} for f in ("a.png", "b.png") for r in ([5, 6], [8])]}
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    out = tmp_path / "out.json"
    args = ["logprobs", "--hf-path", str(ckpt), "--batch", str(tmp_path / "batch.json"), "--out", str(out), "--sharing", "on"]
    assert main(args) == 0
    got = json.loads(out.read_text())
    assert got["groups"] == 2 and got["shared_path"]  # equal tokens, different images: two groups
    processor = image_processor(str(ckpt))
    samples = []
    for i, s in enumerate(batch["samples"]):
        values = processor(images=[Image.open(tmp_path / s["images"][0]).convert("RGB")], return_tensors="pt")
        im = SampleImage.of(values["pixel_values"], values["image_grid_thw"][0])
        samples.append(attach_images(Sample(s["prompt"], s["response"]), [im], image_token_id=cfg.image_token_id, merge=2, index=i))
    with torch.no_grad():
        ref = hf_sample_logprobs(hf_model, samples)
    assert max(max(abs(a - b) for a, b in zip(row["logprobs"], r.tolist())) for row, r in zip(got["samples"], ref)) <= 2e-5
    capsys.readouterr()
    batch["samples"][2]["images"] = ["a.png", "b.png"]
    (tmp_path / "bad.json").write_text(json.dumps(batch))
    err = run_error(capsys, ["logprobs", "--hf-path", str(ckpt), "--batch", str(tmp_path / "bad.json"), "--out", str(out)])
    assert err.strip().splitlines()[-1].endswith("sample 2: 1 image placeholder run(s) (token id 250) for 2 image(s)"), err
