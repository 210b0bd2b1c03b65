"""verl's batch as our samples: each sample's own tokens, its uid, its sampling temperature.

What the forward step packs and what the micro-batching counts are read from a verl TensorDict
(no-padding format: nested `input_ids`, left-padded or nested `prompts`) by these functions only.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ps_bridge.layout import Sample, SampleBatch


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
