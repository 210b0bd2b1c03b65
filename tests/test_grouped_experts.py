"""Grouped MoE experts without TE (`models/experts.py`): one grouped_mm call in bf16 equals the
per-expert loop (forward, input and weight gradients, empty experts included), and the Qwen3.5 MoE
model is built with megatron's TEGroupedMLP in the grouped parameter layout."""

import pytest
import torch

from ps_bridge.models.experts import grouped_linear, stacked, uses_grouped_mm, weight_spans

pytestmark = pytest.mark.core  # also run on the oldest tested stack


def _case(dtype, contiguous_weights, seed=0):
    """contiguous_weights: True (one buffer), False (one storage each), "runs" (two buffers, as
    megatron's DDP buckets may cut a layer's experts)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [5, 0, 9, 1, 0, 17]  # experts without tokens included
    E, d_in, d_out = len(tokens), 32, 48
    x = torch.randn(sum(tokens), d_in, generator=gen).to(dtype).requires_grad_()
    if contiguous_weights == "runs":
        a, b = (torch.randn(k, d_out, d_in, generator=gen).to(dtype) for k in (2, E - 2))
        weights = [torch.nn.Parameter(a[i]) for i in range(2)] + [torch.nn.Parameter(b[i]) for i in range(E - 2)]
    elif contiguous_weights:  # back to back in one storage: the no-copy view path
        w = torch.randn(E, d_out, d_in, generator=gen).to(dtype)
        weights = [p.requires_grad_() for p in (torch.nn.Parameter(w[i]) for i in range(E))]
    else:
        weights = [torch.randn(d_out, d_in, generator=gen).to(dtype).requires_grad_() for _ in range(E)]
    grad_out = torch.randn(sum(tokens), d_out, generator=gen).to(dtype)
    return x, weights, tokens, grad_out


def _loop_float32(x, weights, tokens, grad_out):
    """The per-expert loop on the same (bf16) values, in float32."""
    x32 = x.detach().float().requires_grad_()
    w32 = [w.detach().float().requires_grad_() for w in weights]
    y = grouped_linear(x32, w32, tokens)  # float32: the loop
    y.backward(grad_out.float())
    return y.detach(), x32.grad, [w.grad for w in w32]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("contiguous_weights", [True, False, "runs"])
def test_grouped_mm_bf16_equals_per_expert_loop(contiguous_weights):
    x, weights, tokens, grad_out = _case(torch.bfloat16, contiguous_weights)
    assert uses_grouped_mm(x)
    spans = weight_spans(weights)
    assert spans == {True: [(0, 6)], "runs": [(0, 2), (2, 6)], False: [(i, i + 1) for i in range(6)]}[contiguous_weights]
    assert all(stacked(weights, a, b).data_ptr() == weights[a].data_ptr() for a, b in spans)  # views, no copy
    y = grouped_linear(x, weights, tokens)
    y.backward(grad_out)
    y_ref, gx_ref, gw_ref = _loop_float32(x, weights, tokens, grad_out)
    assert _rel(y, y_ref) < 8e-3
    assert _rel(x.grad, gx_ref) < 8e-3
    for e, (g, r) in enumerate(zip([w.grad for w in weights], gw_ref)):
        if tokens[e] == 0:
            assert g is not None and g.abs().max() == 0 and r.abs().max() == 0
        else:
            assert _rel(g, r) < 8e-3, e
    # and it is the grouped call, not a silent loop: the loop in bf16 rounds per expert the same way
    # only by accident; a wrong offset (experts shifted by one) is far off
    shifted = grouped_linear(x.detach(), weights[1:] + weights[:1], tokens)
    assert _rel(shifted, y_ref) > 0.5


def test_float32_is_the_exact_loop():
    x, weights, tokens, grad_out = _case(torch.float32, True)
    assert not uses_grouped_mm(x)
    y = grouped_linear(x, weights, tokens)
    rows = torch.split(x, tokens)
    assert torch.equal(y, torch.cat([r @ w.t() for r, w in zip(rows, weights)]))


def test_qwen35_moe_builds_grouped_experts(tmp_path_factory):
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from qwen35_helpers import load_tiny
    from ps_bridge.models.experts import GroupedMMColumnLinear, GroupedMMRowLinear

    _, loaded, _ = load_tiny("qwen3.5-moe", tmp_path_factory)
    experts = [m for m in loaded.model.modules() if isinstance(m, TEGroupedMLP)]
    assert experts and all(isinstance(e.linear_fc1, GroupedMMColumnLinear) for e in experts)
    assert all(isinstance(e.linear_fc2, GroupedMMRowLinear) for e in experts)
    names = {n for n, _ in loaded.model.named_parameters()}
    E = loaded.provider.num_moe_experts
    assert f"decoder.layers.0.mlp.experts.linear_fc1.weight{E - 1}" in names
    # the experts lie in one buffer (after loading the checkpoint too): grouped_mm reads one view
    for e in experts:
        for linear in (e.linear_fc1, e.linear_fc2):
            assert weight_spans(linear.weights()) == [(0, E)]
    assert not any("local_experts" in n for n in names)


@pytest.mark.gpu
@pytest.mark.parametrize("contiguous_weights", [True, False])
def test_grouped_mm_bf16_on_the_gpu_equals_per_expert_loop(contiguous_weights):
    x, weights, tokens, grad_out = _case(torch.bfloat16, contiguous_weights)
    x = x.detach().cuda().requires_grad_()
    weights = [w.detach().cuda().requires_grad_() for w in weights]
    y = grouped_linear(x, weights, tokens)
    y.backward(grad_out.cuda())
    y_ref, gx_ref, gw_ref = _loop_float32(x, weights, tokens, grad_out.cuda())
    assert _rel(y, y_ref) < 8e-3 and _rel(x.grad, gx_ref) < 8e-3
    assert all(_rel(w.grad, r) < 8e-3 for w, r, t in zip(weights, gw_ref, tokens) if t)


def test_moe_layer_bench_smoke(tmp_path):
    """The MoE layer bench on its tiny shape (CPU, bf16): grouped and sequential layers agree."""
    import json

    from ps_bridge.tools.bench.moe_layer import main

    out = tmp_path / "moe_layer.json"
    assert main(["--smoke", "--warmup", "0", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["routed_rows"] == result["tokens"] * result["topk"]
    assert result["output_rel_diff"] < 1e-2 and result["input_grad_rel_diff"] < 1e-2


def test_experts_stay_one_run_in_megatrons_ddp_buffer(tmp_path_factory):
    """megatron's DDP with the distributed optimizer copies the parameters into its own buffer in
    reverse registration order; the experts (registered last first) stay one ascending run there."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from qwen35_helpers import load_tiny
    from ps_bridge.models.experts import GroupedMMColumnLinear, GroupedMMRowLinear

    _, loaded, _ = load_tiny("qwen3.5-moe", tmp_path_factory, seed=1)
    ddp = DistributedDataParallel(
        config=loaded.model.config, ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
        module=loaded.model)
    buffers = {b.param_data.untyped_storage().data_ptr() for b in ddp.buffers + ddp.expert_parallel_buffers
               if b.param_data is not None}
    linears = [m for m in loaded.model.modules() if isinstance(m, (GroupedMMColumnLinear, GroupedMMRowLinear))]
    assert linears
    for linear in linears:
        weights = linear.weights()
        assert weights[0].untyped_storage().data_ptr() in buffers  # re-laid by DDP
        assert weight_spans(weights) == [(0, len(weights))]


@pytest.mark.parametrize("contiguous_weights", [True, "runs"])
def test_counts_as_a_tensor_equal_counts_as_a_list(contiguous_weights):
    """megatron's alltoall dispatcher hands the experts their token counts as the device tensor (no
    host sync, `GatherSumAlltoAllTokenDispatcher`): the grouped path takes it as it is (one run) or
    reads it on the host (several runs); values and every gradient equal the list's."""
    x, weights, tokens, grad_out = _case(torch.bfloat16, contiguous_weights)
    results = []
    for counts in (tokens, torch.tensor(tokens)):
        xi = x.detach().clone().requires_grad_()
        wi = [w.detach().clone().requires_grad_() for w in weights]
        y = grouped_linear(xi, wi, counts)
        y.backward(grad_out)
        results.append([y, xi.grad] + [w.grad for w in wi])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _experts_layer(dtype):
    """The grouped experts of a tiny Qwen3.5 MoE model, with routed-looking inputs sorted by expert."""
    from ps_bridge.tools.bench.catalog import FAMILIES, MODEL_SHAPES
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.models.experts import GroupedMMExperts
    from ps_bridge.tools.runtime import load_model_from_hf_config

    shape = MODEL_SHAPES["tiny-qwen3.5-moe"]
    loaded = load_model_from_hf_config(FAMILIES[shape.family](shape.dims, 1), PrefixSharingConfig(enabled=True),
                                       dtype=dtype)
    experts = loaded.model.decoder.layers[0].mlp.experts
    assert type(experts) is GroupedMMExperts and experts._plain()
    E, hidden = experts.num_local_experts, int(loaded.provider.hidden_size)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 9, (E,), generator=gen)
    tokens[1] = 0  # an expert without tokens
    rows = int(tokens.sum())
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    probs = torch.rand(rows, generator=gen)  # megatron's router gives float32 probabilities
    grad = torch.randn(rows, hidden, generator=gen).to(dtype)
    return experts, x, tokens, probs, grad


def _experts_step(forward, experts, x, tokens, probs, grad):
    experts.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    probs = probs.detach().requires_grad_()
    out, bias = forward(experts, x, tokens, probs)
    assert bias is None
    out.backward(grad)
    return [out.detach(), x.grad, probs.grad] + [p.grad for p in experts.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_forward_equals_megatrons(dtype):
    """`GroupedMMExperts`' own forward (device counts kept, `weighted_swiglu`) equals megatron's
    `TEGroupedMLP.forward` on the same layer: exactly in float32 (the per-expert loop, the same
    SwiGLU expression), and in bf16 up to the rounding of the SwiGLU product's one intermediate."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    experts, x, tokens, probs, grad = _experts_layer(dtype)
    ours = _experts_step(lambda m, *a: m(*a), experts, x, tokens, probs, grad)
    theirs = _experts_step(lambda m, *a: TEGroupedMLP.forward(m, *a), experts, x, tokens, probs, grad)
    assert len(ours) == len(theirs) > 4
    for a, b in zip(ours, theirs):
        if dtype == torch.float32:
            assert torch.equal(a, b)
        else:
            assert _rel(a, b) < 1e-2
    # and the probabilities are applied: unit probabilities give another output
    other = _experts_step(lambda m, *a: m(*a), experts, x, tokens, torch.ones_like(probs), grad)
    assert _rel(other[0], ours[0]) > 0.1


def test_weighted_swiglu_fused_formula_equals_naive_on_the_cpu():
    """The fused kernel's forward and hand-written backward (compiled on CUDA only) against the
    naive expression's autograd, float64 on the CPU, uncompiled: values and both gradients."""
    from ps_bridge.kernels import weighted_swiglu as ws

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(50, 2 * 12, generator=gen, dtype=torch.float64, requires_grad=True)
    p = torch.rand(50, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(50, 12, generator=gen, dtype=torch.float64)
    y = ws.naive(h, p)
    y.backward(g)
    dh, dp = ws._backward(g, h.detach(), p.detach())
    assert torch.allclose(ws._forward(h.detach(), p.detach()), y.detach(), rtol=1e-12, atol=1e-12)
    assert torch.allclose(dh, h.grad, rtol=1e-12, atol=1e-12) and torch.allclose(dp, p.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_weighted_swiglu_on_the_gpu_is_compiled_and_equals_naive():
    """On CUDA `weighted_swiglu` is the compiled fused kernel (also where TORCHDYNAMO_DISABLE=1, as
    in this suite): float32 values and gradients equal the naive expression; bf16 is no further from
    float32 than the naive bf16."""
    from ps_bridge.kernels import weighted_swiglu as ws

    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1000, 2 * 96, generator=gen, device="cuda")
    p = torch.rand(1000, generator=gen, device="cuda")
    g = torch.randn(1000, 96, generator=gen, device="cuda")

    def run(fn, h, p):
        h, p = h.detach().requires_grad_(), p.detach().requires_grad_()
        y = fn(h, p)
        y.backward(g.to(y.dtype))
        return y.detach().float(), h.grad.float(), p.grad.float()

    fused32, naive32 = run(ws.weighted_swiglu, h, p), run(ws.naive, h, p)
    assert all(hasattr(f, "_torchdynamo_orig_callable") for f in ws.fused.compiled)
    for a, b in zip(fused32, naive32):
        assert _rel(a, b) < 1e-6
    fused16, naive16 = run(ws.weighted_swiglu, h.bfloat16(), p), run(ws.naive, h.bfloat16(), p)
    for f, q, ref in zip(fused16, naive16, naive32):
        assert _rel(f, ref) <= 1.05 * _rel(q, ref) + 1e-6
