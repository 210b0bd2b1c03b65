"""Image prompts for the Qwen3.5 ConditionalGeneration tests: random images of several grid sizes
for the tiny checkpoints' vision tower (`tiny_checkpoints.build_tiny_qwen35`), placed at their
placeholder runs."""

import torch

from ps_bridge.images import SampleImage, attach_images
from ps_bridge.layout import Sample

# the tiny checkpoints' special ids and their vision tower's patch row (3 channels x temporal
# patch 2 x 4 x 4 pixels) and merge size
IMAGE, VIDEO, START, END = 250, 251, 252, 253
PATCH, MERGE = 96, 2
SYSTEM = [1, 2, 3, 4, 5]


def image(h, w, seed):
    g = torch.Generator().manual_seed(seed)
    return SampleImage.of(torch.randn(h * w, PATCH, generator=g), (1, h, w))


def with_images(sample, images, index=0):
    return attach_images(sample, images, image_token_id=IMAGE, merge=MERGE, video_token_id=VIDEO, index=index)


def image_tokens(im):
    return [START] + [IMAGE] * im.num_tokens(MERGE) + [END]


# grids of several sizes, one not square (mRoPE's h and w rows differ), and equal-size images of
# different pixels (A and A2: the same placeholder tokens)
A, A2, B, C = image(4, 6, 0), image(4, 6, 1), image(2, 4, 2), image(6, 2, 3)


def image_batch(n=3):
    """GRPO-like: four prompts, n responses each. Prompts 0 and 1 have equal tokens but different
    images (A, A2); prompt 2 holds two images; prompt 3 repeats image A after other text."""
    prompts = [
        (SYSTEM + image_tokens(A) + [7, 8, 9], [A]),
        (SYSTEM + image_tokens(A2) + [7, 8, 9], [A2]),
        (SYSTEM + image_tokens(B) + [11] + image_tokens(C) + [12, 13], [B, C]),
        (SYSTEM + [14, 15] + image_tokens(A) + [16], [A]),
    ]
    samples = []
    for p, (tokens, images) in enumerate(prompts):
        for r in range(n):
            response = [20 + p, 30 + r, 40, 50 + p, 60][: 1 + (r + p) % 5]
            samples.append(with_images(Sample(tokens, response, uid=f"p{p}"), images, index=len(samples)))
    return samples


def image_micro_batches():
    """For the parallel runs: the image batch split inside a group (prompt 1's responses on both
    sides), so the same images run in two micro-batches."""
    samples = image_batch()
    return [samples[:5], samples[5:]]
