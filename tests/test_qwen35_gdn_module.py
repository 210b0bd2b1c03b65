"""The prefix-aware GatedDeltaNet *module* (a loaded Qwen3.5 layer): THD and bshd, shared vs unshared.

Hidden states come from leaves (one per prompt, one per response), so outputs and the gradients of
inputs and of the layer's parameters (in_proj, conv1d, A_log, dt_bias, out_norm, out_proj) can be
compared between the prefix-shared THD pack, the bshd rows and the unshared pack.
"""

import pytest
import torch

from qwen35_helpers import load_tiny
from ps_bridge.layout import Sample, build_layout
from ps_bridge.models.packed_seq import PrefixSharedPackedSeqParams


@pytest.fixture(scope="module")
def gdn(tmp_path_factory):
    from ps_bridge.models.gdn import PrefixSharedGatedDeltaNet

    _, loaded, _ = load_tiny("qwen3.5", tmp_path_factory)
    module = loaded.model.decoder.layers[0].self_attention
    assert isinstance(module, PrefixSharedGatedDeltaNet)
    return module


def make_inputs(hidden, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt_lens, group_sizes, response_lens = (6, 2, 9), (3, 1, 2), iter([4, 1, 7, 3, 5, 2])
    prompts, responses, samples, sample_group = [], [], [], []
    for g, (P, n) in enumerate(zip(prompt_lens, group_sizes)):
        prompts.append(torch.randn(P, hidden, generator=gen).requires_grad_(True))
        for _ in range(n):
            R = next(response_lens)
            responses.append(torch.randn(R, hidden, generator=gen).requires_grad_(True))
            samples.append(Sample([10 + g] * P, [1] * R))
            sample_group.append(g)
    return prompts, responses, samples, sample_group


def run_thd(module, prompts, responses, samples, sample_group, share):
    layout = build_layout(samples, share=share, pad_multiple=4)
    pieces, host = [], layout.host
    seg_sample = {int(s): i for i, s in enumerate(layout.sample_segment.tolist())}
    for s in range(layout.num_segments):
        if share:
            x = prompts[s] if s < layout.num_prompt_segments else responses[seg_sample[s]]
        else:
            i = seg_sample[s]
            x = torch.cat([prompts[sample_group[i]], responses[i]])
        pad = host["padded_lengths"][s] - x.shape[0]
        pieces += [x, torch.full((pad, x.shape[1]), 5.0)]
    out, _ = module(torch.cat(pieces).unsqueeze(1), None, packed_seq_params=PrefixSharedPackedSeqParams.from_layout(layout))
    out = out.squeeze(1)
    per_sample = []
    for i in range(len(samples)):
        a, b = layout.row_offsets[i].item(), layout.row_offsets[i + 1].item()
        per_sample.append(out.index_select(0, layout.row_source[a:b]))
    return per_sample


def grads_of(module, leaves, per_sample, weights):
    loss = sum((o * w).sum() for o, w in zip(per_sample, weights))
    params = [p for _, p in module.named_parameters()]
    return torch.autograd.grad(loss, leaves + params)


def test_gdn_module_shared_equals_unshared(gdn):
    hidden = gdn.config.hidden_size
    prompts, responses, samples, sample_group = make_inputs(hidden)
    unshared = run_thd(gdn, prompts, responses, samples, sample_group, share=False)
    shared = run_thd(gdn, prompts, responses, samples, sample_group, share=True)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=gen) for o in unshared]
    leaves = prompts + responses
    g_u = grads_of(gdn, leaves, unshared, weights)
    for name, result in (("thd", shared),):
        out_diff = max((a - b).abs().max().item() for a, b in zip(result, unshared))
        assert out_diff <= 1e-5, (name, out_diff)
        g_s = grads_of(gdn, leaves, result, weights)
        worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(g_s, g_u))
        assert worst <= 1e-5, (name, worst)
