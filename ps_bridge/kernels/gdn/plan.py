"""Where the Gated DeltaNet kernels find prompts, responses and the fork between them.

The GDN kernels run on *compacted* tokens: the valid tokens of every prompt segment first, then the
valid tokens of every response segment. Padding (which the packed layout puts at the end of each
segment) is left out, so a prompt's final conv and recurrent states are taken at its last *valid*
token, and padding never enters any state. The two blocks are two varlen batches: one kernel call
for all prompts (returning their final states) and one for all responses (starting from the state
of their prompt, selected by `response_prompt`).

A plan is built from the packed THD layout (`plan_from_layout`); `build_plan` is its general form
(segments anywhere in the input, each response pointing at its prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ps_bridge.layout import cumulative_offsets


@dataclass
class GDNPlan:
    """Index bookkeeping for one forward pass (built once per micro-batch, reused by every layer).

    gather_index:       `[L]` source positions (in the flattened input) of the compacted tokens:
                        prompt tokens, then response tokens; None when the input is already compact
                        and in that order (no padding, prompts first), so no copy is made.
    num_input_tokens:   flattened input length (padding included).
    num_prompt_tokens:  compacted tokens that belong to prompts (the first block).
    cu_prompts:         `[Np + 1]` cumulative valid lengths of the prompt sequences (int64).
    cu_responses:       `[Nr + 1]` cumulative valid lengths of the response sequences, from 0.
    cu_all:             `[Np + Nr + 1]` prompts and responses as one varlen batch (the compacted
                        tokens in order): the conv runs on it in one call.
    response_prompt:    `[Nr]` index (among the prompt sequences) of each response's prompt.
    *_host:             the same as python lists, so the kernels need no device->host sync.
    """

    gather_index: Optional[torch.Tensor]
    num_input_tokens: int
    num_prompt_tokens: int
    cu_prompts: torch.Tensor
    cu_responses: torch.Tensor
    cu_all: torch.Tensor
    response_prompt: torch.Tensor
    cu_prompts_host: List[int]
    cu_responses_host: List[int]
    cu_all_host: List[int]
    response_prompt_host: List[int]
    _cache: Dict[tuple, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_prompts(self) -> int:
        return len(self.cu_prompts_host) - 1

    @property
    def num_responses(self) -> int:
        return len(self.cu_responses_host) - 1

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.cu_responses_host[-1]

    def prompt_tail_index(self, width: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """For each response, the compacted positions of its prompt's last `width` tokens: a `[Nr * width]`
        index and a `[Nr, width]` mask that is False where the prompt is shorter than `width` (those
        entries of a causal-conv state are zeros). Built from the host lists: no device sync."""
        key = ("prompt_tail", width, str(device))
        if key not in self._cache:
            index, valid = [], []
            for p in self.response_prompt_host:
                start, end = self.cu_prompts_host[p], self.cu_prompts_host[p + 1]
                for pos in range(end - width, end):
                    index.append(pos if pos >= start else start)
                    valid.append(pos >= start)
            self._cache[key] = (
                torch.tensor(index, dtype=torch.long, device=device),
                torch.tensor(valid, dtype=torch.bool, device=device).view(-1, width),
            )
        return self._cache[key]


def build_plan(
    starts: Sequence[int],
    valid_lengths: Sequence[int],
    is_prompt: Sequence[bool],
    prompt_of: Sequence[int],
    num_input_tokens: int,
    device,
) -> GDNPlan:
    """General form: segment `s` occupies input positions `starts[s] .. starts[s] + valid_lengths[s]`;
    a response segment's prompt is segment `prompt_of[s]` (ignored for prompt segments)."""
    prompts = [s for s in range(len(starts)) if is_prompt[s]]
    responses = [s for s in range(len(starts)) if not is_prompt[s]]
    if not prompts:
        raise ValueError("a Gated DeltaNet batch needs at least one prompt (or unshared) sequence")
    prompt_rank = {s: i for i, s in enumerate(prompts)}
    response_prompt = []
    for s in responses:
        p = prompt_of[s]
        if p not in prompt_rank:
            raise ValueError(f"response sequence {s} points to sequence {p}, which is not a prompt")
        response_prompt.append(prompt_rank[p])
    order = prompts + responses
    pieces = [(int(starts[s]), int(valid_lengths[s])) for s in order]
    # contiguous and already in order: the compacted tokens are the input itself
    identity = all(a == b for (a, _), b in zip(pieces, cumulative_offsets(n for _, n in pieces))) and (
        sum(n for _, n in pieces) == num_input_tokens
    )
    gather_index = None
    if not identity:
        gather_index = torch.cat([torch.arange(a, a + n, dtype=torch.long) for a, n in pieces]).to(device)
    cu_p = cumulative_offsets(valid_lengths[s] for s in prompts)
    cu_r = cumulative_offsets(valid_lengths[s] for s in responses)
    cu_all = cumulative_offsets(valid_lengths[s] for s in order)
    return GDNPlan(
        gather_index=gather_index,
        num_input_tokens=int(num_input_tokens),
        num_prompt_tokens=cu_p[-1],
        cu_prompts=torch.tensor(cu_p, dtype=torch.long, device=device),
        cu_responses=torch.tensor(cu_r, dtype=torch.long, device=device),
        cu_all=torch.tensor(cu_all, dtype=torch.long, device=device),
        response_prompt=torch.tensor(response_prompt, dtype=torch.long, device=device),
        cu_prompts_host=cu_p,
        cu_responses_host=cu_r,
        cu_all_host=cu_all,
        response_prompt_host=response_prompt,
    )


def plan_from_layout(layout, device=None) -> GDNPlan:
    """The plan of a packed prefix layout, built once per device and reused by every GDN layer of
    a forward pass (`layout.derived`)."""
    device = torch.device(device) if device is not None else layout.device
    host = layout.host
    n_prompt = layout.num_prompt_segments
    seg_group = host["segment_group"]
    return layout.derived(
        ("gdn_plan", str(device)),
        lambda: build_plan(
            starts=host["cu_seqlens_padded"][:-1],
            valid_lengths=host["valid_lengths"],
            is_prompt=host["segment_is_prompt"],
            # group g's prompt is segment g (prompt segments come first, in group order)
            prompt_of=[seg_group[s] if s >= n_prompt else s for s in range(len(seg_group))],
            num_input_tokens=host["cu_seqlens_padded"][-1],
            device=device,
        ),
    )
