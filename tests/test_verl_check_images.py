"""`ps-bridge verl-check --images` on the CPU, fp32: a tiny Qwen3.5 vision-language checkpoint, every
prompt with its own image handed to the engines as verl's `multi_modal_inputs`. verl's stock engine
cannot build Qwen3.5 here (its stock layer spec needs Transformer Engine), so the first engine is
ps-bridge's with sharing off; the update phase runs with images on both."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

import ps_bridge.tools.verl_check.side_by_side as vt  # noqa: E402

vt.prepare_side_by_side()

from qwen35_helpers import skip_where_vl_refused  # noqa: E402
from ps_bridge.models.qwen35_vl import PrefixSharedQwen35VLModel  # noqa: E402
from ps_bridge.tools import verl_check as check  # noqa: E402
from ps_bridge.tools.cli.verl_check import SMOKE, SMOKE_IMAGES, SMOKE_OVERRIDES  # noqa: E402
from ps_bridge.tools.verl_check.data import VisionInputs, synthetic_batch  # noqa: E402


class FakeVLConfig:
    """The fields `VisionInputs` reads of a vision-language config (the tiny checkpoints' values)."""

    architectures = ["Qwen3_5ForConditionalGeneration"]
    image_token_id, video_token_id, vision_start_token_id, vision_end_token_id = 250, 251, 252, 253

    class vision_config:
        patch_size, temporal_patch_size, spatial_merge_size, in_channels = 4, 2, 2, 3


def test_image_batch_carries_one_image_per_prompt_as_multi_modal_inputs():
    settings = check.CheckSettings(model="x", prompts=3, n=2, prompt_len=5, system_prompt_len=4, response_len=4,
                                   images=1, image_size=(16, 24))
    vision = VisionInputs.of(FakeVLConfig, 1, (16, 24))
    batch, _ = synthetic_batch(settings, 256, 0, {}, vision)
    entries = batch.non_tensor_batch["multi_modal_inputs"]
    prompts = batch.batch["prompts"]
    assert len(entries) == 6 and entries[0] is entries[1] and entries[2] is not entries[0]
    assert tuple(entries[0]["pixel_values"].shape) == (24, 96) and entries[0]["image_grid_thw"].tolist() == [[1, 4, 6]]
    # system prompt (4), <vision_start>, 6 placeholders, <vision_end>, 5 own tokens; no stray special ids
    assert prompts.shape[1] == 4 + 8 + 5
    assert (prompts[:, 4] == 252).all() and (prompts[:, 5:11] == 250).all() and (prompts[:, 11] == 253).all()
    text = np.concatenate([prompts[:, :4].numpy().ravel(), prompts[:, 12:].numpy().ravel(),
                           batch.batch["responses"].numpy().ravel()])
    assert text.max() < 250
    # S counts a prompt's image tokens in its P: 2 samples of (12 + 8) + 4 tokens, shared 20 + 2 x 4
    two = check.CheckSettings(model="x", prompts=1, n=2, prompt_len=12)
    assert check.ideal_ratio(two, [4, 4], image_tokens=8) == pytest.approx(48 / 28)


def test_images_refused_on_a_text_checkpoint_and_at_a_size_the_processor_resizes():
    class Text:
        architectures = ["Qwen3_5ForCausalLM"]

    with pytest.raises(ValueError, match="needs a vision-language checkpoint"):
        VisionInputs.of(Text, 1, (16, 16))
    with pytest.raises(ValueError, match="multiple of patch x merge = 8 pixels"):
        VisionInputs.of(FakeVLConfig, 1, (12, 16))


@pytest.mark.slow
def test_verl_check_with_images_shared_equals_unshared(tmp_path, monkeypatch):
    skip_where_vl_refused()
    calls = {"forward": 0, "images": 0}
    forward, with_images = PrefixSharedQwen35VLModel.forward, PrefixSharedQwen35VLModel._forward_with_images

    def counting_forward(self, *args, **kwargs):
        calls["forward"] += 1
        return forward(self, *args, **kwargs)

    def counting_images(self, *args, **kwargs):
        calls["images"] += 1
        return with_images(self, *args, **kwargs)

    monkeypatch.setattr(PrefixSharedQwen35VLModel, "forward", counting_forward)
    monkeypatch.setattr(PrefixSharedQwen35VLModel, "_forward_with_images", counting_images)
    settings = check.CheckSettings(**dict(SMOKE, **SMOKE_IMAGES, steps=2), images=1, image_size=(16, 24),
                                   overrides=list(SMOKE_OVERRIDES), workdir=str(tmp_path))
    doc = check.run_check(settings)
    # every forward of both engines (old log-probs, ref, the update) took the layout's images
    assert calls["forward"] > 0 and calls["images"] == calls["forward"]
    assert "sharing off" in doc["config"]["stock_engine"]
    assert doc["config"]["images"]["tokens_per_image"] == 6
    assert check.check_failures(doc) == []
    rel = lambda a, b: abs(a - b) / max(abs(a), abs(b), 1e-12)  # noqa: E731
    for s in doc["steps"]:
        assert s["logprob_max_abs_diff"] <= 1e-5 and s["ref_logprob_max_abs_diff"] <= 1e-5
        for u in s["updates"]:
            assert rel(u["loss"]["stock"], u["loss"]["shared"]) <= 1e-5
            assert rel(u["grad_norm"]["stock"], u["grad_norm"]["shared"]) <= 1e-5
    assert all(f > 1 for f in doc["config"]["flop_ratio_F"].values())


def test_phase_flops_count_the_tower_per_sample_unshared_and_per_image_shared():
    from ps_bridge.layout import Sample, build_layout
    from ps_bridge.tools.bench.catalog import MODEL_SHAPES, ImagePrompts, make_image_samples
    from ps_bridge.tools.bench.flops import flop_shape, model_flops
    from ps_bridge.tools.verl_check.flops import PhaseFlops

    shape = flop_shape(MODEL_SHAPES["tiny-qwen3.5-vl"], 4)
    samples = make_image_samples(6, 5, 3, 2, MODEL_SHAPES["tiny-qwen3.5-vl"].dims, ImagePrompts(1, 16, 24), seed=0)
    text = [Sample(s.prompt, s.response) for s in samples]  # the same tokens without their images
    counter = PhaseFlops(shape)
    counter(samples, build_layout(samples, share=True))
    counts = counter.take()
    # by hand for one 16x24 image: tests/test_bench_images.py, TINY_IMAGE_FLOPS
    per_image = 3_686_400 + 516_096
    assert counts["unshared"] == model_flops(shape, build_layout(text, share=False)) + 6 * per_image
    assert counts["shared"] == model_flops(shape, build_layout(text, share=True)) + 2 * per_image
