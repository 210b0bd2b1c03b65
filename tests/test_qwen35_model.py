"""Qwen3.5 (dense and MoE; CausalLM and ConditionalGeneration) through Megatron-Bridge with prefix sharing, on CPU, fp32.

Tiny random checkpoints with 3 Gated DeltaNet layers and 1 full-attention layer, grouped value
heads, partial RoPE, uneven prompt/response lengths.
"""

import pytest
import torch

from qwen35_helpers import (
    cuda_op_formulas_on_cpu,
    export_matches_checkpoint,
    float64_response_logprobs,
    layout_for,
    load_tiny,
    max_abs,
    max_logit_diff_unshared_vs_hf,
    param_grads,
    per_sample_response_logprobs,
    samples_for,
)
from ps_bridge.layout import Sample
from ps_bridge.tools.runtime import load_model
from ps_bridge.tools.tiny_checkpoints import hf_sample_logprobs

# CausalLM and the ConditionalGeneration architectures the official checkpoints declare
ARCHS = ["qwen3.5", "qwen3.5-moe", "qwen3.5-vl", "qwen3.5-moe-vl"]


# the CausalLM cases also run on the oldest tested stack (`core`); the ConditionalGeneration (VL) ones
# do not: on Megatron-Bridge 0.5.0 their shared gradients differ from the unshared ones (not yet
# understood, docs/install.md)
CORE_ARCHS = {"qwen3.5", "qwen3.5-moe"}


@pytest.fixture(scope="module", params=[pytest.param(a, marks=pytest.mark.core) if a in CORE_ARCHS else a for a in ARCHS])
def tiny(request, tmp_path_factory):
    hf, loaded, path = load_tiny(request.param, tmp_path_factory)
    loaded.model.eval()  # eval: no MoE aux loss in the log-prob gradients compared below
    return request.param, hf, loaded, path


def test_megatron_logits_equal_hf(tiny):
    name, hf, loaded, _ = tiny
    assert max_logit_diff_unshared_vs_hf(loaded, hf, samples_for(loaded, num_prompts=2, n=1)) < 1e-5, name


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_shared_logprobs_equal_hf_and_unshared(tiny, pad_multiple):
    name, hf, loaded, _ = tiny
    samples = samples_for(loaded)
    with torch.no_grad():
        shared = per_sample_response_logprobs(loaded, samples, share=True, pad_multiple=pad_multiple)
        unshared = per_sample_response_logprobs(loaded, samples, share=False, pad_multiple=pad_multiple)
        ref = hf_sample_logprobs(hf, samples)
    assert max_abs(shared, ref) <= 1e-5, (name, max_abs(shared, ref))
    assert max_abs(shared, unshared) <= 1e-5, (name, max_abs(shared, unshared))


def test_parameter_gradients_shared_equal_unshared(tiny):
    name, _, loaded, _ = tiny
    samples = samples_for(loaded, num_prompts=2, n=3)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s.response), generator=gen) for s in samples]
    g_shared = param_grads(loaded, samples, True, weights, pad_multiple=2)
    g_unshared = param_grads(loaded, samples, False, weights, pad_multiple=2)
    assert g_shared.keys() == g_unshared.keys() and len(g_shared) > 10
    gdn_params = [n for n in g_shared if "A_log" in n or "conv1d" in n]
    assert gdn_params, "the GDN parameters must receive gradients"
    worst = 0.0
    for n in g_shared:
        scale = g_unshared[n].abs().max().clamp(min=1e-12)
        worst = max(worst, ((g_shared[n] - g_unshared[n]).abs().max() / scale).item())
    assert worst <= 1e-5, (name, worst)


def test_no_sharing_batch_and_groups_of_one(tiny):
    name, hf, loaded, _ = tiny
    # every prompt distinct: the shared layout has groups of one, no response shares a prompt
    samples = [Sample([5, 6, 7], [8, 9]), Sample([1, 2], [3, 4, 5, 6]), Sample([9, 8, 7, 6, 5], [4])]
    layout = layout_for(loaded, samples, share=True)
    assert not layout.has_sharing and layout.num_groups == 3
    with torch.no_grad():
        shared = per_sample_response_logprobs(loaded, samples, share=True, pad_multiple=2)
        unshared = per_sample_response_logprobs(loaded, samples, share=False)
        ref = hf_sample_logprobs(hf, samples)
    assert max_abs(shared, ref) <= 1e-5 and max_abs(unshared, ref) <= 1e-5


def test_export_round_trip_exact(tiny):
    name, _, loaded, path = tiny
    same_names, diff, mismatch = export_matches_checkpoint(loaded, path)
    assert same_names, mismatch
    assert diff == 0.0, (name, diff)


@pytest.mark.parametrize("forgotten", ["recurrent", "conv", "both"])
def test_forgetting_the_state_fork_breaks_equality(tiny, monkeypatch, forgotten):
    """Negative check: responses that start from a zero recurrent state, or a zero conv state, or
    both, no longer match the unshared run (each fork is needed on its own)."""
    import ps_bridge.kernels.gdn.forked as gdn

    name, _, loaded, _ = tiny
    samples = samples_for(loaded, num_prompts=2, n=2)
    with torch.no_grad():
        unshared = per_sample_response_logprobs(loaded, samples, share=False)
        if forgotten in ("recurrent", "both"):
            monkeypatch.setattr(gdn, "fork_states", lambda states, index: torch.zeros_like(states).index_select(0, index))
        if forgotten in ("conv", "both"):
            real_conv = gdn.forked_causal_conv1d
            monkeypatch.setattr(gdn, "forked_causal_conv1d", lambda *args, **kw: real_conv(*args, **dict(kw, fork=False)))
        broken = per_sample_response_logprobs(loaded, samples, share=True)
    # fp32 equality holds to ~1e-6; a forgotten state moves log-probs by 1e-4 at the least here
    print(f"[{name} {forgotten}] {max_abs(broken, unshared):.2e}")
    assert max_abs(broken, unshared) > 1e-4, (name, forgotten)


def test_conditional_generation_refuses_images(tiny):
    from ps_bridge.models.packed_seq import PrefixSharedPackedSeqParams

    name, hf, loaded, _ = tiny
    if not name.endswith("-vl"):
        pytest.skip("text-only architecture")
    image_token = hf.config.image_token_id
    samples = [Sample([5, image_token, 7], [8, 9]), Sample([5, image_token, 7], [3])]
    layout = layout_for(loaded, samples, share=True)
    params = PrefixSharedPackedSeqParams.from_layout(layout)
    with pytest.raises(ValueError, match="image/video placeholder tokens without images"):
        loaded.model(input_ids=layout.tokens[None], position_ids=None, attention_mask=None, packed_seq_params=params)
    text = layout_for(loaded, samples_for(loaded, num_prompts=1, n=2), share=True)
    with pytest.raises(ValueError, match="pixel_values"):
        loaded.model(input_ids=text.tokens[None], position_ids=None, attention_mask=None,
                     packed_seq_params=PrefixSharedPackedSeqParams.from_layout(text),
                     pixel_values=torch.zeros(4, 8))


# The GDN decay gate g = -exp(A_log) * softplus(a + dt_bias). transformers' Qwen3.5 (without
# fla-core, i.e. on CPU) runs the gated delta rule through its chunked torch reference, which casts
# everything to float32 (also in a float64 model) and differentiates g through a within-chunk
# cumulative sum: the gradients of these three parameters carry float32 cancellation errors of
# 1e-5 to 4e-3 relative there, while ours (token-by-token recurrence) are accurate to ~1e-5 in
# float32 and exact in float64. Our float64 gradients are checked against finite differences below,
# HF's against ours only loosely (a wrong head mapping would still be caught). See docs/how-it-works.md.
DECAY_GATE = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")
HF_DECAY_GATE_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def hf_gradients(tiny):
    from ps_bridge.tools.compare import hf_gradient_difference

    name, hf, loaded, _ = tiny
    return name, hf_gradient_difference(loaded, hf, samples_for(loaded, num_prompts=2, n=3))


def test_gradients_equal_hf_gradients(hf_gradients):
    """Every HF parameter's gradient of the prefix-shared log-prob loss equals HF's own; the GDN
    decay gate only up to transformers' float32 error (see DECAY_GATE)."""
    name, r = hf_gradients
    others = {n: d for n, d in r["per_parameter"].items() if not n.endswith(DECAY_GATE)}
    assert len(others) > 10, (name, r)
    assert max(others.values()) <= 1e-5, (name, {n: d for n, d in others.items() if d > 1e-5})
    gate = {n: d for n, d in r["per_parameter"].items() if n.endswith(DECAY_GATE)}
    assert len(gate) == 3 * 3, (name, gate)  # three GDN layers
    assert max(gate.values()) <= HF_DECAY_GATE_TOLERANCE, (name, gate)
    assert r["max_abs_grad_unreached"] == 0.0, (name, r["max_abs_grad_unreached"])


@pytest.fixture(scope="module")
def tiny64(tiny):
    """The same checkpoint loaded in float64."""
    name, _, _, path = tiny
    return name, load_model(path, dtype=torch.float64)


@pytest.fixture
def float64_attention_gate(monkeypatch):
    """megatron-core's attention output gate takes its sigmoid in float32 whatever the model dtype,
    which leaves float32 rounding in a float64 model's loss; take it in float32 *at least* here."""
    from megatron.core.transformer.attention import Attention

    def output_gate(self, x, gate):
        acc = torch.promote_types(x.dtype, torch.float32)
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).to(acc))).to(x.dtype)

    monkeypatch.setattr(Attention, "_apply_output_gate", output_gate)


def decay_gate_entries(model):
    """(name, parameter, flat index) of every A_log and dt_bias entry of every GDN layer, and of two
    columns of each one's decay-gate rows of in_proj (HF's in_proj_a: the last value-head rows)."""
    from ps_bridge.models.gdn import PrefixSharedGatedDeltaNet

    entries = []
    for name, module in model.named_modules():
        if isinstance(module, PrefixSharedGatedDeltaNet):
            entries += [(f"{name}.A_log", module.A_log, i) for i in range(module.A_log.numel())]
            entries += [(f"{name}.dt_bias", module.dt_bias, i) for i in range(module.dt_bias.numel())]
            w = module.in_proj.weight
            heads = module.A_log.numel()
            entries += [(f"{name}.in_proj_a", w, (w.shape[0] - heads + h) * w.shape[1] + c) for h, c in ((0, 3), (heads - 1, 17))]
    assert len(entries) == 3 * (2 * 4 + 2), len(entries)
    return entries


def float64_decay_gate_gradients(loaded, samples, weights, share=True):
    model = loaded.model
    model.zero_grad(set_to_none=True)
    lps = float64_response_logprobs(loaded, samples, share)
    sum((w.double() * lp).sum() for w, lp in zip(weights, lps)).backward()
    grads = {(n, i): p.grad.view(-1)[i].item() for n, p, i in decay_gate_entries(model)}
    model.zero_grad(set_to_none=True)
    return grads


def test_decay_gate_gradients_equal_finite_differences(tiny64, float64_attention_gate):
    """The decay-gate gradients of a float64 model equal central finite differences of its loss."""
    from ps_bridge.tools.compare import loss_weights

    name, loaded = tiny64
    if "moe" in name:
        pytest.skip("megatron's MoE router takes its softmax in float32 whatever the model dtype, too "
                    "coarse for finite differences; the GDN layers are those of the dense architectures")
    samples = samples_for(loaded, num_prompts=2, n=3)
    weights = loss_weights(samples)
    grads = float64_decay_gate_gradients(loaded, samples, weights)

    def loss():
        lps = float64_response_logprobs(loaded, samples, share=True)
        return sum((w.double() * lp).sum() for w, lp in zip(weights, lps)).item()

    h, errors = 1e-5, {}
    with torch.no_grad():
        for n, p, i in decay_gate_entries(loaded.model):
            flat = p.view(-1)
            x = flat[i].item()
            flat[i] = x + h
            up = loss()
            flat[i] = x - h
            down = loss()
            flat[i] = x
            fd = (up - down) / (2 * h)
            errors[(n, i)] = (abs(grads[(n, i)] - fd), fd)
    bad = {k: (grads[k], fd, e) for k, (e, fd) in errors.items() if e > 2e-8 + 1e-6 * abs(fd)}
    assert not bad, (name, bad)


def test_float32_decay_gate_gradients_equal_float64(tiny, tiny64, float64_attention_gate):
    """The float32 model's decay-gate gradients (the run compared with HF above) are within 1e-4
    (norm-relative, per parameter) of the float64 model's, i.e. of the finite differences."""
    from ps_bridge.tools.compare import loss_weights

    name, _, loaded, _ = tiny
    _, loaded64 = tiny64
    samples = samples_for(loaded, num_prompts=2, n=3)
    weights = loss_weights(samples)
    ref = float64_decay_gate_gradients(loaded64, samples, weights)
    got = float64_decay_gate_gradients(loaded, samples, weights)
    worst = {}
    for layer_param in {n for n, _ in ref}:
        keys = [k for k in ref if k[0] == layer_param]
        a = torch.tensor([got[k] for k in keys], dtype=torch.float64)
        b = torch.tensor([ref[k] for k in keys], dtype=torch.float64)
        worst[layer_param] = float((a - b).norm() / b.norm())
    assert max(worst.values()) <= 1e-4, (name, worst)


@pytest.mark.parametrize("share", [True, False])
def test_cuda_op_formulas_give_the_models_values_and_gradients(tiny, share):
    """The Qwen3.5 model (every norm, the GDN gates and l2 norm, the MoE experts' SwiGLU) through the
    forward and backward formulas of its CUDA paths (the norms' `row_norm.RowNorm`, the gates'
    `triton_gates.Gates`, the SwiGLU's `CompiledOp`) and their wiring (rows flattened, the gate's column
    slices, the gated output norm) gives the log-probs and parameter gradients of the plain ops."""
    name, _, loaded, _ = tiny
    samples = samples_for(loaded, num_prompts=2, n=3)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s.response), generator=gen) for s in samples]
    with cuda_op_formulas_on_cpu():
        with torch.no_grad():
            got_lp = per_sample_response_logprobs(loaded, samples, share=share)
        got = param_grads(loaded, samples, share, weights)
    with torch.no_grad():
        want_lp = per_sample_response_logprobs(loaded, samples, share=share)
    want = param_grads(loaded, samples, share, weights)
    assert max_abs(got_lp, want_lp) <= 1e-5, (name, max_abs(got_lp, want_lp))
    assert got.keys() == want.keys()
    for n in got:
        scale = want[n].abs().max().clamp(min=1e-12)
        assert ((got[n] - want[n]).abs().max() / scale).item() <= 1e-5, (name, n)
