"""verl-check's synthetic GRPO data, and its ideal token ratio S."""

from __future__ import annotations

from typing import List

import torch

from ps_bridge.verl.check.config import CheckSettings


def synthetic_batch(settings: CheckSettings, vocab: int, step: int, algo_cfg):
    """One trainer step's batch as the trainer holds it after the rollout: left-padded prompts,
    right-padded responses, uid, random outcome rewards and verl's GRPO advantages."""
    import numpy as np
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    g = torch.Generator().manual_seed(settings.seed * 1000 + step)
    P, R, n = settings.prompt_len, settings.response_len, settings.n
    B = settings.prompts * n
    lo, hi = max(1, R // 2), max(1, R + R // 2)
    lengths = torch.randint(lo, hi + 1, (B,), generator=g)
    Rmax = int(lengths.max())
    prompts = torch.randint(3, vocab, (settings.prompts, P), generator=g).repeat_interleave(n, dim=0)
    responses = torch.randint(3, vocab, (B, Rmax), generator=g)
    response_mask = (torch.arange(Rmax)[None, :] < lengths[:, None]).long()
    responses = responses * response_mask
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    rewards = torch.zeros(B, Rmax)
    rewards[torch.arange(B), lengths - 1] = torch.rand(B, generator=g)
    uid = np.array([f"s{step}p{i // n}" for i in range(B)], dtype=object)
    advantages, returns = compute_grpo_outcome_advantage(
        rewards, response_mask, uid, norm_adv_by_std_in_grpo=algo_cfg.get("norm_adv_by_std_in_grpo", True))
    batch = DataProto.from_dict(
        tensors=dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], dim=1),
                     attention_mask=attention_mask, position_ids=position_ids, response_mask=response_mask,
                     token_level_rewards=rewards, advantages=advantages, returns=returns),
        non_tensors={"uid": uid},
    )
    return batch, lengths.tolist()


def ideal_ratio(settings: CheckSettings, response_lengths: List[int]) -> float:
    """S = sum of n(P + R_j) over sum of (P + sum R_j): the batch's unshared / shared token ratio."""
    P, n = settings.prompt_len, settings.n
    unshared = sum(P + r for r in response_lengths)
    groups = [response_lengths[i:i + n] for i in range(0, len(response_lengths), n)]
    shared = sum(P + sum(g) for g in groups)
    return unshared / shared
