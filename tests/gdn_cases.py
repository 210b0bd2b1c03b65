"""Shared/unshared Gated DeltaNet inputs built from the same leaf tensors (for kernel tests).

Each group has one prompt input block `[P, ...]`; each sample has its response block `[R, ...]`.
The unshared computation sees `[prompt; response]` per sample; the shared one sees each prompt
once. Both are assembled from the same leaves, so gradients can be compared leaf by leaf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from ps_bridge.layout import Sample, build_layout


@dataclass
class GDNCase:
    num_key_heads: int
    key_head_dim: int
    num_value_heads: int
    value_head_dim: int
    conv_width: int
    samples: List[Sample]
    prompt_leaves: list  # per group: (mixed [P, D], g [P, HV], beta [P, HV])
    response_leaves: list  # per sample: (mixed [R, D], g [R, HV], beta [R, HV])
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor
    sample_group: List[int]

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def leaves(self):
        out = [self.conv_weight, self.conv_bias]
        for t in self.prompt_leaves + self.response_leaves:
            out.extend(t)
        return out

    def sample_inputs(self, i):
        """(mixed, g, beta) of sample i's whole sequence [prompt; response]."""
        p = self.prompt_leaves[self.sample_group[i]]
        r = self.response_leaves[i]
        return tuple(torch.cat([a, b]) for a, b in zip(p, r))


def make_case(seed=0, group_sizes=(3, 1, 2), prompt_lens=(7, 3, 11), response_lens=None, dtype=torch.float64,
              H=2, K=8, HV=4, V=6, W=4) -> GDNCase:
    gen = torch.Generator().manual_seed(seed)
    D = 2 * H * K + HV * V

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=dtype) * scale).requires_grad_(True)

    def log_decay(n):
        # g = -exp(A) * softplus(a): negative, as in the model
        return (-torch.rand(n, HV, generator=gen, dtype=dtype) * 0.5).requires_grad_(True)

    def betas(n):
        return torch.rand(n, HV, generator=gen, dtype=dtype).requires_grad_(True)

    samples, sample_group, prompt_leaves, response_leaves = [], [], [], []
    lens = iter(response_lens or [5, 1, 9, 4, 2, 6, 3, 8, 7, 2])
    for g_idx, (n, P) in enumerate(zip(group_sizes, prompt_lens)):
        prompt = [100 + g_idx * 10 + t for t in range(P)]
        prompt_leaves.append((rnd(P, D), log_decay(P), betas(P)))
        for _ in range(n):
            R = next(lens)
            samples.append(Sample(prompt, [1 + t for t in range(R)]))
            sample_group.append(g_idx)
            response_leaves.append((rnd(R, D), log_decay(R), betas(R)))
    return GDNCase(H, K, HV, V, W, samples, prompt_leaves, response_leaves,
                   rnd(D, W, scale=0.5), rnd(D, scale=0.1), sample_group)


def packed_inputs(case: GDNCase, layout, pad_value=7.0):
    """(mixed, g, beta) in the packed order of `layout`; padding holds `pad_value` garbage."""
    host = layout.host
    T = layout.num_tokens
    parts = {name: [] for name in range(3)}
    offsets = host["cu_seqlens_padded"]
    seg_of_sample = layout.sample_segment.tolist()
    sources = []
    for s in range(layout.num_segments):
        if layout.shared:
            if s < layout.num_prompt_segments:
                src = case.prompt_leaves[s]
            else:
                src = case.response_leaves[seg_of_sample.index(s)]
        else:
            src = case.sample_inputs(seg_of_sample.index(s))
        sources.append(src)
    for s, src in enumerate(sources):
        pad = offsets[s + 1] - offsets[s] - src[0].shape[0]
        for j in range(3):
            parts[j].append(src[j])
            if pad:
                parts[j].append(torch.full((pad, src[j].shape[1]), pad_value, dtype=src[j].dtype, device=src[j].device))
    out = tuple(torch.cat(parts[j]) for j in range(3))
    assert out[0].shape[0] == T
    return out


def sample_outputs(out, layout):
    """Per sample, the GDN outputs of its whole sequence [prompt; response], from packed output."""
    src = layout.row_source
    res = []
    for i in range(layout.num_samples):
        a, b = layout.row_offsets[i].item(), layout.row_offsets[i + 1].item()
        res.append(out.index_select(0, src[a:b]))
    return res


# The one Gated DeltaNet head configuration of every GPU test (tests/*_gpu.py): fla's Triton kernels
# autotune once per (key heads, value heads, head dims, dtype), minutes each on a fresh machine, so
# the GPU tests share it (2 key heads, 4 value heads: grouped value heads; head dims 64).
GPU_GDN_HEADS = dict(H=2, HV=4, K=64, V=64)


def tiny_qwen35_gpu_gdn_heads() -> dict:
    """`build_tiny_qwen35` overrides giving its GDN layers the heads of `GPU_GDN_HEADS`."""
    h = GPU_GDN_HEADS
    return dict(linear_num_key_heads=h["H"], linear_num_value_heads=h["HV"],
                linear_key_head_dim=h["K"], linear_value_head_dim=h["V"])
