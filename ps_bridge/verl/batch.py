"""verl's batch as our samples: each sample's own tokens, its images, its uid, its sampling temperature.

What the forward step packs and what the micro-batching counts are read from a verl TensorDict
(no-padding format: nested `input_ids`, left-padded or nested `prompts`) by these functions only.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from ps_bridge.images import SampleImage, attach_images
from ps_bridge.layout import Sample, SampleBatch

# what a sample's `multi_modal_inputs` entry may carry with prefix sharing (the image processor's outputs)
IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def uid_list(batch) -> Optional[list]:
    """verl's per-sample `uid` (a non-tensor column of the TensorDict), or None."""
    if "uid" not in batch.keys():
        return None
    return [str(u) for u in batch["uid"]]


def prompt_lengths(batch) -> List[int]:
    """Per sample, the prompt length: the nested `prompts`' lengths, or the left-padded `prompts`
    block of `attention_mask`."""
    prompts = batch["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff().tolist()
    return batch["attention_mask"][:, : prompts.shape[1]].sum(dim=1).tolist()


def samples_from_micro_batch(batch) -> SampleBatch:
    """Each sample's own tokens from verl's nested `input_ids` (the exact tokens the stock engine
    feeds), cut at its prompt length; the flat token array kept with them (`layout.SampleBatch`)."""
    input_ids = batch["input_ids"]
    uids = uid_list(batch)
    offsets = input_ids.offsets().cpu().numpy().astype(np.int64)
    flat = input_ids.values().cpu().numpy().astype(np.int64)  # a copy: later changes of the batch stay out
    # a prompt length past its sequence cuts the whole sequence (the layout then refuses its empty response)
    prompts = np.minimum(np.asarray(prompt_lengths(batch), dtype=np.int64), np.diff(offsets))
    tokens = flat.tolist()
    samples = []
    for i, (start, end, P) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), prompts.tolist())):
        samples.append(Sample(tokens[start : start + P], tokens[start + P : end], None if uids is None else uids[i]))
    return SampleBatch(samples, flat, offsets, prompts)


def per_sample_temperature(batch, num_samples: int, device) -> torch.Tensor:
    temperature = batch["temperature"]
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.tensor([float(temperature)] * num_samples)
    temperature = temperature.to(device=device, dtype=torch.float32).reshape(-1).clone()
    if temperature.numel() == 1:
        temperature = temperature.expand(num_samples).clone()
    temperature[temperature <= 0] = 1e-8  # as the stock engine: padding may carry 0
    return temperature


def temperature_classes(temperature: torch.Tensor) -> Optional[List[float]]:
    """The layout's `share_classes` for these per-sample temperatures: None when they are all equal,
    else each sample's temperature (a shared position's logits are scaled by one temperature, so
    samples of different temperatures never share a position)."""
    values = temperature.tolist()
    return None if len(set(values)) <= 1 else values


# the non-tensor key under which the engine hands a batch its model's vision settings (`mark_vision`)
VISION_KEY = "ps_bridge_vision"


def has_multi_modal_inputs(batch) -> bool:
    """verl's trainer hands text-only batches a `multi_modal_inputs` entry too (one empty dict per sample):
    what counts is whether verl's own extraction finds any input in it."""
    entries = batch.get("multi_modal_inputs", None)
    if entries is None:
        return False
    # what verl's `extract_multi_modal_inputs` keeps (an entry's values that are not None), without
    # calling it: it concatenates every sample's pixel_values (the whole batch's pixels, copied) to answer
    return any(_entry(e) for e in entries)


def mark_vision(data, hf_config) -> None:
    """Hand `data` the model's image settings, so that what reads its samples without the engine (the
    micro-batcher's plan) places the images as the forward step does (`samples_of`)."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.utils import tensordict_utils as tu

    if getattr(hf_config, "image_token_id", None) is not None:
        tu.assign_non_tensor_data(data, VISION_KEY, hf_config)


def samples_of(batch, hf_config=None) -> List[Sample]:
    """The micro-batch's samples (`samples_from_micro_batch`) with their images where it carries any
    (`samples_with_images`; `hf_config`: the model's, else the one `mark_vision` left on the batch)."""
    samples = samples_from_micro_batch(batch)
    if not has_multi_modal_inputs(batch):
        return samples
    # imported here: verl is optional (requirements-verl.txt)
    from verl.utils import tensordict_utils as tu

    config = hf_config if hf_config is not None else tu.get_non_tensor_data(batch, key=VISION_KEY, default=None)
    return samples_with_images(samples, batch.get("multi_modal_inputs"), config)


def _entry(value) -> dict:
    """One sample's `multi_modal_inputs` entry as a dict (verl keeps it as NonTensorData or a dict; None: text)."""
    value = getattr(value, "data", value)
    return {} if value is None else {k: v for k, v in dict(value).items() if v is not None}


def samples_with_images(samples: SampleBatch, entries, hf_config) -> List[Sample]:
    """`samples` with the images of verl's per-sample `multi_modal_inputs` entries (`pixel_values`
    `[patches, C*T*P*P]` of the sample's images, `image_grid_thw` `[images, 3]`) placed at their image
    placeholder runs (`images.attach_images`: a count that does not match is refused naming the
    sample). Any other key (videos: `pixel_values_videos`, `video_grid_thw`) is refused by name."""
    entries = [_entry(e) for e in entries]
    if len(entries) != len(samples):
        raise ValueError(f"multi_modal_inputs has {len(entries)} entries for {len(samples)} samples")
    image_token = getattr(hf_config, "image_token_id", None)
    vision = getattr(hf_config, "vision_config", None)
    if image_token is None or vision is None:
        raise ValueError("the batch carries multi_modal_inputs but the model has no vision tower (no image_token_id)")
    merge = int(vision.spatial_merge_size)
    out = []
    # verl repeats a prompt's entry for its n responses (the same tensors): their images are made once,
    # so sharing compares one `ImageContent` object (fingerprinted once) for all n
    made: Dict[tuple, List[SampleImage]] = {}
    for i, (sample, entry) in enumerate(zip(samples, entries)):
        other = sorted(set(entry) - set(IMAGE_KEYS))
        if other:
            raise ValueError(f"sample {i}: multi_modal_inputs key(s) {other} are not supported with prefix sharing "
                             "(images only: pixel_values, image_grid_thw)")
        images = []
        if entry:
            grids = torch.as_tensor(entry["image_grid_thw"]).reshape(-1, 3)
            # the entries list holds every tensor until the loop ends: an id is not reused within it
            key = (id(entry["pixel_values"]), tuple(map(tuple, grids.tolist())))
            if key not in made:
                pixels = torch.split(entry["pixel_values"], grids.prod(-1).tolist())
                made[key] = [SampleImage.of(p, g) for p, g in zip(pixels, grids)]
            images = made[key]
        out.append(attach_images(sample, images, image_token_id=image_token, merge=merge,
                                 video_token_id=getattr(hf_config, "video_token_id", None), index=i))
    given = samples.sequences()
    # the same tokens: the layout keeps reading them from the batch's array (a plain list is flattened there)
    return out if given is None else SampleBatch(out, *given)
