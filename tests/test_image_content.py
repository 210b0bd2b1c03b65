"""What sharing compares of an image (`images.ImageContent`) and what reading verl's image entries costs:
equal pixel bytes in other memory are the same image, pixels that differ anywhere (outside the rows
the fingerprint reads too) are not, however equal their placeholder tokens; the n repeats of one
prompt's entry are one image object; nothing reads the pixels where nothing is shared, and an
unshared pack carries a repeated image's memory once. No model."""

from __future__ import annotations

import torch

from image_cases import IMAGE, MERGE, PATCH, SYSTEM, image_tokens, with_images
from ps_bridge.images import FINGERPRINT_ROWS, IMAGE_KEY_BASE, SampleImage, pack_images, sharing_keys
from ps_bridge.layout import Sample, SampleBatch, _flatten, build_layout, find_groups
from ps_bridge.verl.batch import has_multi_modal_inputs, samples_with_images

GRID = (1, 64, 64)  # 4096 patch rows: more than the fingerprint reads


def big_image(seed: int) -> torch.Tensor:
    return torch.randn(GRID[1] * GRID[2], PATCH, generator=torch.Generator().manual_seed(seed))


def unread_row() -> int:
    """A patch row the fingerprint does not read (it reads FINGERPRINT_ROWS evenly spaced rows)."""
    rows = GRID[1] * GRID[2]
    read = set(torch.linspace(0, rows - 1, FINGERPRINT_ROWS).round().long().tolist())
    return next(r for r in range(rows) if r not in read)


def test_pixels_differing_outside_the_fingerprint_are_other_images_with_equal_tokens():
    pixels = big_image(0)
    other = pixels.clone()
    other[unread_row(), 5] += 1.0
    a, a_copy, b = SampleImage.of(pixels, GRID), SampleImage.of(pixels.clone(), GRID), SampleImage.of(other, GRID)
    # the fingerprint cannot tell a from b: only the byte comparison does
    assert a.content.fingerprint == b.content.fingerprint and hash(a.content) == hash(b.content)
    assert a.content != b.content and a.content == a_copy.content
    tokens = SYSTEM + image_tokens(a) + [7, 8]
    samples = [with_images(Sample(tokens, [9, r]), [im], index=r) for r, im in enumerate([a, b, a_copy])]
    assert find_groups(samples) == [[0, 2], [1]]
    flat, offsets, _ = _flatten(samples, None)
    keys = sharing_keys(samples, flat, offsets)
    start = len(SYSTEM) + 1
    run = slice(start, start + a.num_tokens(MERGE))
    assert (flat[offsets[0]:][run] == IMAGE).all() and (flat[offsets[1]:][run] == IMAGE).all()
    assert (keys[offsets[0]:][run] == IMAGE_KEY_BASE).all() and (keys[offsets[1]:][run] == IMAGE_KEY_BASE + 1).all()
    assert (keys[offsets[2]:][run] == IMAGE_KEY_BASE).all()
    # the prefix tree shares the system prompt and <vision_start> with b, the whole prompt with the copy
    layout = build_layout(samples, share="tree", min_shared=0)
    assert layout.images.num_images == 2 and layout.images.occurrences == 3


def test_contents_compare_bytes_not_float_values():
    zeros = torch.zeros(24, PATCH)
    nans = torch.full((24, PATCH), float("nan"))
    grid = (1, 4, 6)
    # -0.0 == 0.0 as floats but not as bytes; NaN != NaN as floats, a copy of its bytes is the same image
    assert SampleImage.of(zeros, grid).content != SampleImage.of(-zeros, grid).content
    assert SampleImage.of(nans, grid).content == SampleImage.of(nans.clone(), grid).content
    # the same bytes under another grid or dtype are another image
    assert SampleImage.of(zeros, grid).content != SampleImage.of(zeros, (1, 6, 4)).content
    assert SampleImage.of(zeros, grid).content != SampleImage.of(zeros.view(torch.int32), grid).content


class VLConfig:
    image_token_id, video_token_id = IMAGE, 251

    class vision_config:
        spatial_merge_size = MERGE


def entry_batch(n: int):
    """Two prompts of n responses as verl hands them: each prompt's entry repeated n times (one dict,
    the same tensors), the second prompt's pixels a copy of the first's except one unread row."""
    first = big_image(1)
    second = first.clone()
    second[unread_row(), 0] = -second[unread_row(), 0]
    grid = torch.tensor([GRID])
    entries = [{"pixel_values": first, "image_grid_thw": grid}, {"pixel_values": second, "image_grid_thw": grid}]
    tokens = SYSTEM + [252] + [IMAGE] * (GRID[1] * GRID[2] // MERGE**2) + [253, 7]
    samples = [Sample(tokens, [9, r]) for r in range(2 * n)]
    return SampleBatch(samples, *_flatten(samples, None)), [entries[i // n] for i in range(2 * n)]


def test_repeated_entries_make_one_image_and_text_prompts_read_no_pixels(monkeypatch):
    samples, entries = entry_batch(n=4)
    with_images = samples_with_images(samples, entries, VLConfig)
    images = [s.images[0].image for s in with_images]
    assert all(im is images[0] for im in images[:4]) and all(im is images[4] for im in images[4:])
    # sharing off: nothing compares the images (no fingerprint is taken), and the unshared pack's
    # tower input holds each prompt's memory once, repeated on its way to the model
    unshared = build_layout(with_images, share=False)
    assert all(im.content._fingerprint is None for im in images)
    assert images[0].content != images[4].content
    assert find_groups(with_images) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    packed = unshared.images
    assert packed.num_images == 8 and [b.data_ptr() for b in packed.pixel_blocks] == [
        entries[0]["pixel_values"].data_ptr(), entries[4]["pixel_values"].data_ptr()]
    assert torch.equal(packed.pixel_values, torch.cat([im.pixel_values for im in images]))
    # verl's extraction would concatenate the batch's pixels to say whether there are any
    monkeypatch.setattr(torch, "cat", lambda *a, **k: (_ for _ in ()).throw(AssertionError("pixels copied")))
    assert has_multi_modal_inputs({"multi_modal_inputs": entries})
    assert not has_multi_modal_inputs({"multi_modal_inputs": [{}, None, {"pixel_values": None}]})


def test_samples_with_images_keeps_the_batch_arrays():
    samples, entries = entry_batch(n=2)
    out = samples_with_images(samples, entries, VLConfig)
    assert isinstance(out, SampleBatch) and out.sequences()[0] is samples.sequences()[0]
    assert out[0].images[0].image.pixel_values.data_ptr() == entries[0]["pixel_values"].data_ptr()


def test_unshared_pack_of_distinct_memory_is_the_plain_concatenation():
    a, b = (SampleImage.of(torch.randn(24, PATCH), (1, 4, 6)) for _ in range(2))
    samples = [with_images(Sample(SYSTEM + image_tokens(im) + [7], [8]), [im], index=i) for i, im in enumerate([a, b])]
    flat, offsets, _ = _flatten(samples, None)
    packed = pack_images(samples, offsets, torch.arange(int(offsets[-1])).numpy(),
                         torch.arange(int(offsets[-1])).numpy(), dedupe=False)
    assert packed.pixel_index is None and torch.equal(packed.pixel_values, torch.cat([a.pixel_values, b.pixel_values]))
