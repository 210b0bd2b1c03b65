"""verl-check's synthetic GRPO data, and its ideal token ratio S.

Each prompt is `N` system-prompt tokens (the same in every prompt of the run, `--system-prompt-len`)
followed by `P` tokens of its own; n responses per prompt. With `--images K` (a vision-language
checkpoint) each prompt carries K random images of its own between the two, each
`<vision_start> <image_pad> x tokens <vision_end>`, and the batch a `multi_modal_inputs` entry per sample
as verl's multimodal data flow carries it (the image processor's `pixel_values` and `image_grid_thw`;
the n samples of a prompt hold the same entry, as `DataProto.repeat` leaves them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from ps_bridge.tools.bench.catalog import VISION_IDS, ImagePrompts, image_tokens, random_images
from ps_bridge.tools.verl_check.config import CheckSettings


@dataclass(frozen=True)
class VisionInputs:
    """What `--images` needs of a vision-language checkpoint's config: its special ids and the tower's
    patch geometry (`vision`, the vision config's fields), and the run's images (`ImagePrompts`)."""

    images: ImagePrompts
    vision: dict
    ids: dict  # image_token_id, video_token_id, vision_start_token_id, vision_end_token_id

    @classmethod
    def of(cls, hf_config, per_prompt: int, size: Tuple[int, int]) -> "VisionInputs":
        v = getattr(hf_config, "vision_config", None)
        if v is None or getattr(hf_config, "image_token_id", None) is None:
            raise ValueError(f"--images needs a vision-language checkpoint (a vision tower and image_token_id); "
                             f"this one declares {list(getattr(hf_config, 'architectures', None) or [])}")
        vision = {k: getattr(v, k) for k in ("patch_size", "temporal_patch_size", "spatial_merge_size")}
        vision["in_channels"] = getattr(v, "in_channels", 3)
        ids = {k: getattr(hf_config, k) for k in VISION_IDS}
        inputs = cls(ImagePrompts(per_prompt, *size), vision, ids)
        inputs.images.grid(vision)  # a size the image processor would resize is refused now
        return inputs

    @property
    def prompt_tokens(self) -> int:
        """A prompt's image tokens, start/end tokens included."""
        return self.images.prompt_tokens(0, self.vision)

    @property
    def text_vocab(self) -> int:
        """Text tokens are drawn below this id (the vision special ids and above are left out)."""
        return min(self.ids.values())

    def prompt_images(self, prompts: int, g: torch.Generator):
        """Per prompt: its image tokens (`[prompts, prompt_tokens]`) and its `multi_modal_inputs` entry
        (random pixel rows `[images * t*h*w, C*T*P*P]` and `image_grid_thw` `[images, 3]`)."""
        tokens, entries = [], []
        for _ in range(prompts):
            pictures = random_images(self.images, self.vision, g)
            tokens.append(image_tokens(pictures, self.ids, self.vision))
            entries.append({"pixel_values": torch.cat([p.pixel_values for p in pictures]),
                            "image_grid_thw": torch.tensor([p.grid_thw for p in pictures])})
        return torch.tensor(tokens), entries


def synthetic_tokens(settings: CheckSettings, vocab: int, step: int, vision: Optional["VisionInputs"] = None):
    """A step's tokens: prompts `[B, prompt tokens]` (each prompt's row repeated n times), responses
    `[B, longest]` (random past each one's length), the response lengths `[B]` (drawn from [R/2, 3R/2]),
    each prompt's images (`vision`; else None), and the step's generator, which draws the rest."""
    g = torch.Generator().manual_seed(settings.seed * 1000 + step)
    P, R, n = settings.prompt_len, settings.response_len, settings.n
    B = settings.prompts * n
    lo, hi = max(1, R // 2), max(1, R + R // 2)
    lengths = torch.randint(lo, hi + 1, (B,), generator=g)
    text_vocab = vocab if vision is None else vision.text_vocab
    own = torch.randint(3, text_vocab, (settings.prompts, P), generator=g)
    parts = [system_prompt(settings, text_vocab).expand(settings.prompts, -1)]
    entries = None
    if vision is not None:
        tokens, entries = vision.prompt_images(settings.prompts, g)
        parts.append(tokens)
    prompts = torch.cat(parts + [own], dim=1).repeat_interleave(n, dim=0)
    responses = torch.randint(3, text_vocab, (B, int(lengths.max())), generator=g)
    return prompts, responses, lengths, entries, g


def synthetic_batch(settings: CheckSettings, vocab: int, step: int, algo_cfg, vision: Optional["VisionInputs"] = None):
    """One trainer step's batch as the trainer holds it after the rollout: left-padded prompts,
    right-padded responses, uid, random outcome rewards and verl's GRPO advantages. Every prompt
    begins with the run's system prompt (`system_prompt`); with `vision` (`--images`) its images
    follow, and text tokens stay below the vision special ids."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    prompts, responses, lengths, entries, g = synthetic_tokens(settings, vocab, step, vision)
    n, B, Rmax = settings.n, responses.shape[0], responses.shape[1]
    response_mask = (torch.arange(Rmax)[None, :] < lengths[:, None]).long()
    responses = responses * response_mask
    attention_mask = torch.cat([torch.ones(B, prompts.shape[1], dtype=torch.long), response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    rewards = torch.zeros(B, Rmax)
    rewards[torch.arange(B), lengths - 1] = torch.rand(B, generator=g)
    uid = np.array([f"s{step}p{i // n}" for i in range(B)], dtype=object)
    advantages, returns = compute_grpo_outcome_advantage(
        rewards, response_mask, uid, norm_adv_by_std_in_grpo=algo_cfg.get("norm_adv_by_std_in_grpo", True))
    non_tensors = {"uid": uid}
    if entries is not None:
        non_tensors["multi_modal_inputs"] = np.array([entries[i // n] for i in range(B)], dtype=object)
    batch = DataProto.from_dict(
        tensors=dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], dim=1),
                     attention_mask=attention_mask, position_ids=position_ids, response_mask=response_mask,
                     token_level_rewards=rewards, advantages=advantages, returns=returns),
        non_tensors=non_tensors,
    )
    return batch, lengths.tolist()


def system_prompt(settings: CheckSettings, vocab: int) -> torch.Tensor:
    """The run's system prompt: `settings.system_prompt_len` tokens, the same in every step."""
    g = torch.Generator().manual_seed(settings.seed * 1000 + 999)
    return torch.randint(3, vocab, (1, settings.system_prompt_len), generator=g)


def ideal_ratio(settings: CheckSettings, response_lengths: List[int], image_tokens: int = 0) -> float:
    """S = sum of (N + P + R_j) over each step's system prompt once plus sum of (P + sum R_j) per
    prompt: the batch's unshared / shared token ratio (with N = 0: n(P + R) over P + nR). A prompt's
    images (`image_tokens`, their start/end tokens included) count in its P."""
    N, P, n = settings.system_prompt_len, settings.prompt_len + image_tokens, settings.n
    unshared = sum(N + P + r for r in response_lengths)
    groups = [response_lengths[i:i + n] for i in range(0, len(response_lengths), n)]
    steps = -(-len(response_lengths) // (settings.prompts * n))
    shared = steps * N + sum(P + sum(g) for g in groups)
    return unshared / shared
