"""verl-check's synthetic GRPO data, and its ideal token ratio S.

Each prompt is `N` system-prompt tokens (the same in every prompt of the run, `--system-prompt-len`)
followed by `P` tokens of its own; n responses per prompt."""

from __future__ import annotations

from typing import List

import numpy as np
import torch

from ps_bridge.tools.verl_check.config import CheckSettings


def synthetic_batch(settings: CheckSettings, vocab: int, step: int, algo_cfg):
    """One trainer step's batch as the trainer holds it after the rollout: left-padded prompts,
    right-padded responses, uid, random outcome rewards and verl's GRPO advantages. Every prompt
    begins with the run's system prompt (`system_prompt`)."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    g = torch.Generator().manual_seed(settings.seed * 1000 + step)
    P, R, n = settings.prompt_len, settings.response_len, settings.n
    B = settings.prompts * n
    lo, hi = max(1, R // 2), max(1, R + R // 2)
    lengths = torch.randint(lo, hi + 1, (B,), generator=g)
    Rmax = int(lengths.max())
    own = torch.randint(3, vocab, (settings.prompts, P), generator=g)
    prompts = torch.cat([system_prompt(settings, vocab).expand(settings.prompts, -1), own], dim=1)
    prompts = prompts.repeat_interleave(n, dim=0)
    responses = torch.randint(3, vocab, (B, Rmax), generator=g)
    response_mask = (torch.arange(Rmax)[None, :] < lengths[:, None]).long()
    responses = responses * response_mask
    attention_mask = torch.cat([torch.ones(B, prompts.shape[1], dtype=torch.long), response_mask], dim=1)
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


def system_prompt(settings: CheckSettings, vocab: int) -> torch.Tensor:
    """The run's system prompt: `settings.system_prompt_len` tokens, the same in every step."""
    g = torch.Generator().manual_seed(settings.seed * 1000 + 999)
    return torch.randint(3, vocab, (1, settings.system_prompt_len), generator=g)


def ideal_ratio(settings: CheckSettings, response_lengths: List[int]) -> float:
    """S = sum of (N + P + R_j) over each step's system prompt once plus sum of (P + sum R_j) per
    prompt: the batch's unshared / shared token ratio (with N = 0: n(P + R) over P + nR)."""
    N, P, n = settings.system_prompt_len, settings.prompt_len, settings.n
    unshared = sum(N + P + r for r in response_lengths)
    groups = [response_lengths[i:i + n] for i in range(0, len(response_lengths), n)]
    steps = -(-len(response_lengths) // (settings.prompts * n))
    shared = steps * N + sum(P + sum(g) for g in groups)
    return unshared / shared
