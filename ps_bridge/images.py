"""Images behind a sample's image placeholder tokens: what sharing compares, and what the pack carries.

A Qwen3.5 vision-language prompt holds one run of image placeholder tokens per image
(`<|vision_start|><|image_pad|>...<|image_pad|><|vision_end|>`, `t*h*w / merge^2` placeholders for an
image of patch grid `(t, h, w)`). The placeholder ids are the same for every image, so token ids alone
cannot say whether two prompts are the same: a sample carries its images (`Sample.images`, one
`ImageSpan` per run, `attach_images`), each image with the key sharing compares it by
(`SampleImage.content`, an `ImageContent`: equal where the grid, dtype, shape and pixel bytes are).
Everything that decides sharing reads `sharing_keys`: the tokens, with each placeholder replaced by an
id of its image's content. Two samples then share a position only where their tokens and the images
behind their placeholders are the same; a prefix tree over prompts that share a system prompt but
carry different images shares the system prompt only.

Comparing copies none of the pixels and hashes a few patch rows per image: the n responses of a
prompt carry views of one `pixel_values` tensor (verl repeats a prompt's `multi_modal_inputs` entry n
times), the same bytes by their address; other images are told apart by a fingerprint of a few patch
rows, and only images whose fingerprints agree are compared byte for byte. The pixels stay on the
device they came on until the layout moves the distinct ones to the model's.

Once packed, `pack_images` gives the layout (`PackedPrefixLayout.images`) what the model needs:
- the pixels of each *distinct* image once (a shared layout runs the vision tower once per distinct
  image of the micro-batch; an unshared one once per occurrence, as the stock model does), and for
  every packed image position the row of the tower's output it takes (a shared position is one row
  read once; the same image at unshared positions is one row read several times, so its gradient
  sums over every sample that reads it);
- the mRoPE `(t, h, w)` position of every packed token, as transformers' `get_rope_index`
  (models/qwen3_5/modeling_qwen3_5.py, `Qwen3_5Model.get_rope_index`) computes it for the token's own
  sequence `prompt + response`: text tokens advance all three rows by one, an image's tokens take
  `(start, start + row, start + column)` and the text after it continues at `start + max(h, w) / merge`.
  A response therefore continues from its own prompt's positions.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ps_bridge.packed_layout import Sample
from ps_bridge.transfer import to_device

# sharing keys of image placeholders: above every vocabulary, one per distinct image of the micro-batch
IMAGE_KEY_BASE = 1 << 40


# rows of an image's `pixel_values` its fingerprint reads (evenly spaced, first and last included)
FINGERPRINT_ROWS = 64


def _same_bytes_in_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are views of the same memory with the same layout (then the same bytes)."""
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def _as_words(pixels: torch.Tensor) -> torch.Tensor:
    """The bytes of `pixels` as a flat integer tensor (equal exactly where the bytes are: no NaN or
    signed-zero rules of float comparison); 8-byte words where the size allows (torch compares those
    several times faster than single bytes)."""
    raw = pixels.contiguous().reshape(-1).view(torch.uint8)
    return raw.view(torch.int64) if raw.numel() % 8 == 0 and raw.storage_offset() % 8 == 0 else raw


class ImageContent:
    """What sharing compares of one image: equal to another exactly where the grid, dtype, shape and
    pixel bytes are. Hashed by its grid, dtype, shape and a fingerprint of `FINGERPRINT_ROWS` patch
    rows (computed at the first hash, on the host: a GPU tensor's rows are copied there), so dicts and
    sets bucket images cheaply; `==` then compares the bytes only where those agree and the two are
    not views of the same memory."""

    __slots__ = ("pixels", "grid", "_fingerprint")

    def __init__(self, pixels: torch.Tensor, grid: Tuple[int, int, int]):
        self.pixels = pixels
        self.grid = grid
        self._fingerprint: Optional[bytes] = None

    @property
    def fingerprint(self) -> bytes:
        if self._fingerprint is None:
            rows = self.pixels.shape[0]
            pick = torch.linspace(0, rows - 1, min(rows, FINGERPRINT_ROWS)).round().long().unique() if rows else None
            sample = self.pixels[pick.to(self.pixels.device)] if rows else self.pixels
            words = sample.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            self._fingerprint = hashlib.sha256(memoryview(words)).digest()
        return self._fingerprint

    def _layout(self) -> tuple:
        return self.grid, str(self.pixels.dtype), tuple(self.pixels.shape)

    def __hash__(self) -> int:
        return hash((self._layout(), self.fingerprint))

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, ImageContent) or self._layout() != other._layout():
            return False
        a, b = self.pixels, other.pixels
        if _same_bytes_in_place(a, b):
            return True
        if self.fingerprint != other.fingerprint:
            return False
        return torch.equal(_as_words(a), _as_words(b).to(a.device))

    def __repr__(self) -> str:
        return f"ImageContent(grid={self.grid}, {self.pixels.dtype}, {tuple(self.pixels.shape)})"


@dataclass(frozen=True, eq=False)
class SampleImage:
    """One image as the model's image processor gives it: `pixel_values` `[t*h*w, C*T*P*P]` (patches,
    on the device they came on) and its patch grid `grid_thw`."""

    pixel_values: torch.Tensor
    grid_thw: Tuple[int, int, int]

    @functools.cached_property
    def content(self) -> ImageContent:
        """What sharing compares (equal where grid, dtype, shape and pixel bytes are); built once, so
        its fingerprint is taken once per image."""
        return ImageContent(self.pixel_values, self.grid_thw)

    @classmethod
    def of(cls, pixel_values: torch.Tensor, grid_thw) -> "SampleImage":
        grid = tuple(int(x) for x in (grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw))
        if len(grid) != 3 or min(grid) < 1:
            raise ValueError(f"an image's grid_thw is (t, h, w) of positive integers, got {grid}")
        pixels = pixel_values.detach()
        if pixels.dim() != 2 or pixels.shape[0] != grid[0] * grid[1] * grid[2]:
            raise ValueError(f"an image of grid {grid} has {grid[0] * grid[1] * grid[2]} patch rows, "
                             f"its pixel_values have shape {tuple(pixels.shape)}")
        return cls(pixels, grid)

    def num_tokens(self, merge: int) -> int:
        """Its placeholder tokens in the language model (one per merged `merge x merge` patch block)."""
        t, h, w = self.grid_thw
        return t * h * w // (merge * merge)


@dataclass(frozen=True)
class ImageSpan:
    """Image `image` behind the placeholders `[start, end)` of a sample's sequence `prompt + response`;
    `merge`: the vision tower's spatial merge size the span was counted with."""

    start: int
    end: int
    image: SampleImage
    merge: int


def placeholder_runs(tokens: Sequence[int], token_id: int) -> List[Tuple[int, int]]:
    """`[start, end)` of each run of `token_id` (transformers groups consecutive placeholders into one
    image the same way)."""
    ids = np.asarray(tokens, dtype=np.int64)
    hit = np.concatenate([[False], ids == token_id, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def attach_images(sample, images: Sequence[SampleImage], *, image_token_id: int, merge: int,
                  video_token_id: Optional[int] = None, index: int = 0):
    """`sample` (a `Sample`) with `images` placed at its image placeholder runs, in order. Refused with
    one line naming sample `index`: a run count or run length that does not match the images, video
    placeholders (videos are not supported)."""
    sequence = list(sample.prompt) + list(sample.response)
    if video_token_id is not None and video_token_id in sequence:
        raise ValueError(f"sample {index}: video placeholder tokens (id {video_token_id}): videos are not supported "
                         "with prefix sharing (pixel_values_videos); use the stock model for video data")
    runs = placeholder_runs(sequence, image_token_id)
    if len(runs) != len(images):
        raise ValueError(f"sample {index}: {len(runs)} image placeholder run(s) (token id {image_token_id}) "
                         f"for {len(images)} image(s)")
    spans = []
    for k, ((a, b), image) in enumerate(zip(runs, images)):
        if b - a != image.num_tokens(merge):
            raise ValueError(f"sample {index}: image {k} (grid {image.grid_thw}, merge {merge}) needs "
                             f"{image.num_tokens(merge)} placeholder tokens, its run has {b - a}")
        if a < len(sample.prompt) < b:
            raise ValueError(f"sample {index}: image {k}'s placeholders straddle the prompt's end")
        spans.append(ImageSpan(a, b, image, merge))
    return Sample(list(sample.prompt), list(sample.response), sample.uid, tuple(spans) or None)


def has_images(samples: Sequence) -> bool:
    return any(getattr(s, "images", None) for s in samples)


def image_signature(sample) -> tuple:
    """What, beyond its tokens, decides a sample's sharing: its images' places and contents."""
    return tuple((span.start, span.image.content) for span in (getattr(sample, "images", None) or ()))


def prompt_image_signature(sample) -> tuple:
    """`image_signature` of the images inside the prompt (what groups identical prompts)."""
    P = len(sample.prompt)
    return tuple((span.start, span.image.content) for span in (getattr(sample, "images", None) or ()) if span.start < P)


def sharing_keys(samples: Sequence, flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The tokens sharing compares: `flat` itself without images, else a copy whose placeholders hold
    `IMAGE_KEY_BASE + k`, `k` the index of their image's content among the micro-batch's distinct
    images (equal placeholders of different images differ; the same image at the same place is equal)."""
    if not has_images(samples):
        return flat
    keys = flat.copy()
    ids: Dict[ImageContent, int] = {}
    for i, s in enumerate(samples):
        for span in s.images or ():
            k = ids.setdefault(span.image.content, len(ids))
            keys[offsets[i] + span.start : offsets[i] + span.end] = IMAGE_KEY_BASE + k
    return keys


def sequence_mrope(length: int, spans: Sequence[ImageSpan]) -> np.ndarray:
    """`[3, length]` mRoPE positions of one sequence with image `spans`, as transformers'
    `get_rope_index` (see the module docstring)."""
    out = np.empty((3, length), dtype=np.int64)
    pos, t = 0, 0
    for span in sorted(spans, key=lambda s: s.start):
        n = span.start - t
        out[:, t : span.start] = pos + np.arange(n)
        pos += n
        gt, gh, gw = span.image.grid_thw
        gh, gw = gh // span.merge, gw // span.merge
        out[0, span.start : span.end] = pos + np.repeat(np.arange(gt), gh * gw)
        out[1, span.start : span.end] = pos + np.tile(np.repeat(np.arange(gh), gw), gt)
        out[2, span.start : span.end] = pos + np.tile(np.arange(gw), gt * gh)
        pos += max(gh, gw)
        t = span.end
    out[:, t:] = pos + np.arange(length - t)
    return out


@dataclass
class PackedImages:
    """What a packed micro-batch with images gives the model (see the module docstring).

    pixel_values `[patches, C*T*P*P]`, grid_thw `[I, 3]`: the images the vision tower runs, in order.
    `pixel_values` is made where it is read, from `pixel_blocks` (the distinct memory blocks among the
    images, each moved to the device by itself: one pinned host copy each, no host concatenation) read
    at `pixel_index` where a block occurs more than once (an unshared pack's repeats of one prompt's
    image then cross to the device once and are repeated there);
    image_positions `[K]`: the packed positions of image placeholders, sorted; image_rows `[K]`: the
    row of the tower's output (concatenated over its images) each of them takes; mrope `[3, T]`: every
    packed token's (t, h, w) position (padding: its layout position in all three rows);
    merge: the spatial merge size; occurrences: image runs in the unshared batch (for the log)."""

    pixel_blocks: Tuple[torch.Tensor, ...]
    grid_thw: torch.Tensor
    image_positions: torch.Tensor
    image_rows: torch.Tensor
    mrope: torch.Tensor
    merge: int
    occurrences: int
    pixel_index: Optional[torch.Tensor] = None  # rows of the blocks' concatenation, in order (None: all of them)

    @property
    def pixel_values(self) -> torch.Tensor:
        """The tower's input rows: the distinct blocks concatenated and indexed, a new tensor on every
        read (the model reads it once per forward)."""
        if not self.pixel_blocks:
            return torch.zeros(0, 0)
        pixels = self.pixel_blocks[0] if len(self.pixel_blocks) == 1 else torch.cat(self.pixel_blocks)
        if self.pixel_index is None:
            return pixels
        return pixels.index_select(0, self.pixel_index.to(pixels.device))

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])

    def to(self, device) -> "PackedImages":
        index = None if self.pixel_index is None else to_device(self.pixel_index, device)
        return PackedImages(tuple(to_device(b, device) for b in self.pixel_blocks), self.grid_thw,
                            to_device(self.image_positions, device), to_device(self.image_rows, device),
                            to_device(self.mrope, device), self.merge, self.occurrences, index)

    def local(self, shard: Optional[slice]):
        """(image positions inside `shard`, offsets local to it; their rows; mrope `[3, t]` of the shard)."""
        if shard is None:
            return self.image_positions, self.image_rows, self.mrope
        inside = (self.image_positions >= shard.start) & (self.image_positions < shard.stop)
        return self.image_positions[inside] - shard.start, self.image_rows[inside], self.mrope[:, shard]

    def describe(self) -> str:
        return f"images={self.num_images} (of {self.occurrences} in the batch), image_tokens={int(self.image_positions.numel())}"


def pack_images(samples: Sequence, flat_offsets: np.ndarray, token_source: np.ndarray, positions: np.ndarray,
                *, dedupe: bool) -> PackedImages:
    """The `PackedImages` of a pack whose token `j` is flat token `token_source[j]` of the samples'
    sequences (`-1`: padding, at layout position `positions[j]`). `dedupe`: one tower input per
    distinct image (shared layouts) or per packed image run (unshared: the stock computation)."""
    total = int(flat_offsets[-1])
    mrope = np.empty((3, total), dtype=np.int64)
    occurrence = np.full(total, -1, dtype=np.int64)  # per flat token: its image run, numbered over the batch
    within = np.zeros(total, dtype=np.int64)
    runs: List[ImageSpan] = []
    merges = set()
    for i, s in enumerate(samples):
        a, b = int(flat_offsets[i]), int(flat_offsets[i + 1])
        spans = s.images or ()
        mrope[:, a:b] = sequence_mrope(b - a, spans)
        for span in spans:
            merges.add(span.merge)
            occurrence[a + span.start : a + span.end] = len(runs)
            within[a + span.start : a + span.end] = np.arange(span.end - span.start)
            runs.append(span)
    if len(merges) > 1:
        raise ValueError(f"the micro-batch's images were counted with different spatial merge sizes {sorted(merges)}")
    valid = token_source >= 0
    src = np.where(valid, token_source, 0)
    packed_mrope = np.where(valid[None, :], mrope[:, src], positions[None, :])
    packed_run = np.where(valid, occurrence[src], -1)
    image_positions = np.flatnonzero(packed_run >= 0)
    run_of_position = packed_run[image_positions]
    # the tower's inputs: distinct images (by content) or packed runs, in order of first packed appearance
    tower_of_run: Dict[int, int] = {}
    tower_images: List[ImageSpan] = []
    by_content: dict = {}
    for r in dict.fromkeys(run_of_position.tolist()):
        key = runs[r].image.content if dedupe else ("run", r)
        if key not in by_content:
            by_content[key] = len(tower_images)
            tower_images.append(runs[r])
        tower_of_run[r] = by_content[key]
    merge = merges.pop() if merges else 1
    tokens = np.asarray([span.image.num_tokens(merge) for span in tower_images], dtype=np.int64)
    first_row = np.concatenate([[0], np.cumsum(tokens)[:-1]]).astype(np.int64)
    tower = np.fromiter((tower_of_run[r] for r in run_of_position.tolist()), dtype=np.int64, count=run_of_position.size)
    rows = first_row[tower] + within[token_source[image_positions]]
    as_long = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))  # noqa: E731
    sources, index = distinct_pixel_blocks([span.image.pixel_values for span in tower_images])
    return PackedImages(
        pixel_blocks=tuple(sources),
        grid_thw=torch.tensor([span.image.grid_thw for span in tower_images], dtype=torch.long).reshape(-1, 3),
        image_positions=as_long(image_positions),
        image_rows=as_long(rows),
        mrope=as_long(packed_mrope),
        merge=merge,
        occurrences=len(runs),
        pixel_index=index,
    )


def distinct_pixel_blocks(pixels: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
    """The tensors of `pixels` that are not views of the same memory as an earlier one, and the rows of
    their concatenation that give `torch.cat(pixels)` (None where all are distinct). Only the memory
    address is compared (no bytes read): equal pixels in two places stay two blocks."""
    sources: List[torch.Tensor] = []
    starts: List[int] = []
    block_of: List[int] = []
    for p in pixels:
        k = next((j for j, s in enumerate(sources) if _same_bytes_in_place(s, p)), None)
        if k is None:
            k = len(sources)
            starts.append(sum(int(s.shape[0]) for s in sources))
            sources.append(p)
        block_of.append(k)
    if len(sources) == len(pixels):
        return sources, None
    index = torch.cat([torch.arange(starts[k], starts[k] + int(pixels[i].shape[0])) for i, k in enumerate(block_of)])
    return sources, index
