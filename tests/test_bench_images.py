"""`ps-bridge bench --images`: image-prompt rows on a tiny Qwen3.5 vision-language shape, on the CPU in
float32. The vision tower runs once per distinct image shared and once per sample unshared, F counts it
(checked against a count by hand), and the shared and unshared log-probs agree."""

from __future__ import annotations

import argparse
import json

import pytest

from ps_bridge.tools import bench
from ps_bridge.tools.bench.catalog import MODEL_SHAPES, ImagePrompts, make_image_samples
from ps_bridge.tools.bench.flops import flop_shape


def parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    return parser.parse_args(argv)


# By hand, tiny-qwen3.5-vl's tower (2 layers, hidden 32, MLP 64, patch row 3 x 2 x 4 x 4 = 96, merge 2,
# output 64) on one 16x24-pixel image (patch grid 1 x 4 x 6: 24 patches in one frame, 6 merged tokens):
#   patch embedding 24 x 96 x 32 = 73,728; layers 2 x 24 x (4 x 32^2 + 2 x 32 x 64) = 393,216;
#   merger 6 x (128^2 + 128 x 64) = 147,456; linear 614,400 multiply-adds -> x 2 x 3 = 3,686,400
#   attention 2 layers x 4 x 32 x 24^2 = 147,456 -> x 3.5 = 516,096
TINY_IMAGE_FLOPS = 3_686_400 + 516_096


def test_vision_flops_of_one_image_match_the_count_by_hand():
    shape = flop_shape(MODEL_SHAPES["tiny-qwen3.5-vl"], 4)
    assert shape.vision.image_flops((1, 4, 6)) == TINY_IMAGE_FLOPS


def test_qwen35_9b_vl_shape_cuts_its_tower_with_the_text_layers():
    # 1024 x 1024 pixels at patch 16, merge 2: 64 x 64 patches, 1,024 merged tokens
    prompts = ImagePrompts(1, 1024, 1024)
    vision = MODEL_SHAPES["qwen3.5-9b-vl"].dims["vision"]
    assert prompts.grid(vision) == (1, 64, 64) and prompts.tokens_per_image(vision) == 1024
    assert flop_shape(MODEL_SHAPES["qwen3.5-9b-vl"], 4).vision.depth == 3  # round(27 x 4 / 32)
    assert flop_shape(MODEL_SHAPES["qwen3.5-9b-vl"], 4, vision_layers=27).vision.depth == 27


def test_image_samples_carry_their_own_image_and_no_stray_placeholders():
    dims = MODEL_SHAPES["tiny-qwen3.5-vl"].dims
    samples = make_image_samples(40, 30, 3, 2, dims, ImagePrompts(1, 16, 24), seed=0)
    contents = [s.images[0].image.content for s in samples]
    assert len(set(contents[:3])) == 1 and len(set(contents[3:])) == 1 and contents[0] != contents[3]
    for s in samples:
        tokens = s.prompt + s.response
        assert tokens.count(dims["image_token_id"]) == 6 and dims["video_token_id"] not in tokens
        assert len(s.prompt) == 1 + 6 + 1 + 40


@pytest.mark.slow
def test_bench_image_rows_share_the_tower_and_count_it(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--smoke", "--images", "1", "--groups", "2", "--no-progress", "--json", str(out), "--fp32-reference"]
    assert bench.run_bench(parse(argv)) == 0
    text = capsys.readouterr().out
    assert "vision tower 2 of 2 layers" in text and "14 (6 text)" in text
    (row,) = json.loads(out.read_text())["rows"]
    assert row["error"] is None and row["model"] == "tiny-qwen3.5-vl"
    images, P, R, n = row["images"], 14, row["R"], row["n"]
    # the tower ran once per prompt's image shared, once per sample unshared
    assert images["tower_images_shared"] == 2 and images["tower_images_unshared"] == 2 * n
    assert images["vision_flops_shared"] == 2 * TINY_IMAGE_FLOPS
    assert images["vision_flops_unshared"] == 2 * n * TINY_IMAGE_FLOPS
    # F is the whole model's ratio, the tower included
    assert row["flop_ratio"] == pytest.approx(images["model_flops_unshared"] / images["model_flops_shared"])
    text_only = (images["model_flops_unshared"] - images["vision_flops_unshared"]) / (
        images["model_flops_shared"] - images["vision_flops_shared"])
    assert row["flop_ratio"] > text_only  # the tower runs n times unshared, once shared
    assert row["tokens_unshared"] == 2 * n * (P + R) and row["tokens_shared"] == 2 * (P + n * R)
    assert row["ideal_speedup"] == pytest.approx(n * (P + R) / (P + n * R))
    # float32 on the CPU: shared and unshared log-probs agree, and both equal the float32 twin's
    assert row["max_logprob_diff"] <= 2e-5
    for key in ("shared_max_err_fp32", "unshared_max_err_fp32"):
        assert row[key] is not None and row[key] <= 2e-5


def test_bench_refuses_images_on_text_shapes_and_trees(capsys):
    assert bench.run_bench(parse(["--smoke", "--images", "1", "--models", "tiny-qwen3.5"])) == 2
    assert "tiny-qwen3.5 has no vision tower" in capsys.readouterr().err
    assert bench.run_bench(parse(["--smoke", "--images", "1", "--trees", "system"])) == 2
    assert "drop --trees" in capsys.readouterr().err
    assert bench.run_bench(parse(["--smoke", "--images", "1", "--image-size", "20x24"])) == 2
    assert "multiple of patch x merge = 8 pixels" in capsys.readouterr().err
