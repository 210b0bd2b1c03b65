"""verl's engine with image prompts (Qwen3.5 ConditionalGeneration), on the CPU, fp32: the micro-batch
as verl's trainer hands it, with a `multi_modal_inputs` entry per sample (the image processor's
`pixel_values` and `image_grid_thw`). Our engine shares each group's prompt and image once; its
response log-probs equal transformers' `Qwen3_5ForConditionalGeneration` and our engine's unshared
run, in both of verl's micro-batching modes."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

import torch  # noqa: E402

import ps_bridge.tools.verl_check.side_by_side as vt  # noqa: E402

vt.prepare_side_by_side()

from qwen35_helpers import skip_where_vl_refused  # noqa: E402
from ps_bridge.config import PrefixSharingConfig  # noqa: E402
from image_cases import A, A2, B, C, image_tokens, with_images  # noqa: E402
from ps_bridge.layout import Sample  # noqa: E402
from ps_bridge.tools.tiny_checkpoints import hf_sample_logprobs  # noqa: E402
from ps_bridge.verl.engine import PrefixSharedMegatronEngine  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402



def batch_samples(n=3):
    """Three prompts of n responses: two with equal tokens and different images, one with two images."""
    prompts = [([1, 2, 3] + image_tokens(A) + [7, 8], [A]), ([1, 2, 3] + image_tokens(A2) + [7, 8], [A2]),
               ([1, 2, 3] + image_tokens(B) + [9] + image_tokens(C) + [10], [B, C])]
    samples = []
    for p, (tokens, images) in enumerate(prompts):
        for r in range(n):
            s = Sample(tokens, [20 + p, 30 + r, 40][: 1 + (r + p) % 3], uid=f"p{p}")
            samples.append(with_images(s, images, index=len(samples)))
    return samples


def with_multi_modal_inputs(td, samples):
    """verl's per-sample `multi_modal_inputs` entries (a non-tensor column of dicts)."""
    entries = [{"pixel_values": torch.cat([sp.image.pixel_values for sp in s.images]),
                "image_grid_thw": torch.tensor([sp.image.grid_thw for sp in s.images])} for s in samples]
    tu.assign_non_tensor_stack(td, "multi_modal_inputs", entries)
    return td


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    skip_where_vl_refused()
    path = str(tmp_path_factory.mktemp("q35vl"))
    hf = vt.tiny_checkpoint(path, "qwen3.5-vl")
    ours = vt.build_engine(PrefixSharedMegatronEngine, path, use_remove_padding=True)
    return hf, ours


def infer(engine, td, config):
    engine.prefix_sharing_config = config
    with vt.engine_call_on_cpu(), engine.eval_mode():
        return engine.infer_batch(td)["model_output"]


@pytest.mark.parametrize("batching", [dict(micro_batch_size=9), dict(max_token_len=60)], ids=["static", "dynamic"])
def test_image_batch_logprobs_equal_hf_and_unshared(setup, batching, caplog):
    hf, ours = setup
    samples = batch_samples()
    td = with_multi_modal_inputs(vt.grpo_micro_batch(samples, **batching), samples)
    with caplog.at_level("INFO", logger="ps_bridge"):
        shared = no_padding_2_padding(infer(ours, td, PrefixSharingConfig(enabled=True))["log_probs"], td)
    assert "PATH 6: sharing detected" in caplog.text and "images=" in caplog.text
    td = with_multi_modal_inputs(vt.grpo_micro_batch(samples, **batching), samples)
    unshared = no_padding_2_padding(infer(ours, td, PrefixSharingConfig(enabled=False))["log_probs"], td)
    with torch.no_grad():
        ref = hf_sample_logprobs(hf, samples)
    for got in (shared, unshared):
        assert max((got[i, : len(r)] - r).abs().max().item() for i, r in enumerate(ref)) <= 2e-5


def test_image_batch_policy_loss_gradients_equal_unshared(setup, tmp_path_factory):
    """A PPO loss's gradients through the engine (forward_backward_batch), vision tower included, with
    the images shared and unshared."""
    from test_verl_engine import grads_after_backward  # the engine tests' PPO loss and gradient read-out

    hf, _ = setup
    path = str(tmp_path_factory.mktemp("q35vl_train"))
    vt.tiny_checkpoint(path, "qwen3.5-vl")
    engine = vt.build_engine(PrefixSharedMegatronEngine, path, use_remove_padding=True, forward_only=False)
    samples = batch_samples()
    grads = {}
    for name, config in (("shared", PrefixSharingConfig(enabled=True)), ("unshared", PrefixSharingConfig(enabled=False))):
        engine.prefix_sharing_config = config
        grads[name] = grads_after_backward(engine, with_multi_modal_inputs(vt.grpo_micro_batch(samples, micro_batch_size=9), samples))
    ref = grads["unshared"]
    vision = [n for n in ref if "vision_model" in n and ref[n].abs().max() > 0]
    assert any("merger" in n for n in vision), sorted(ref)
    worst = max(((grads["shared"][n] - ref[n]).abs().max() / ref[n].abs().max().clamp(min=1e-12)).item() for n in ref)
    assert worst <= 1e-5, worst
