"""The fast attention backends against `torch_ref`.

CPU (CI): the cascade and the expand design run on torch's CPU flash op (`CpuFlashKernel`), so the
LSE merge, the merged-output backward and the key/value bookkeeping are checked exactly (float64);
FlexAttention's mask runs eagerly on the CPU (forward). GPU (marker `gpu`, skipped without CUDA):
every backend in bf16 against the float32 reference by relative error, outputs and gradients.
"""

from __future__ import annotations

import random

import pytest
import torch

from ps_bridge.kernels.attention import BACKENDS, get_attention_backend
from ps_bridge.kernels.attention import cascade, expand, merge, varlen
from ps_bridge.kernels.attention.flex import bucket_length
from ps_bridge.layout import Sample, build_layout
from ps_bridge.rows import PackedRows


def make_layout(kind: str, pad: int, seed: int = 0, prompt=(3, 11), response=(1, 9), groups=3, n=(1, 4)):
    rng = random.Random(seed)
    samples = []
    for _ in range(groups):
        p = [rng.randrange(50) for _ in range(rng.randint(*prompt))]
        members = 1 if kind == "groups_of_one" else rng.randint(*n)
        for _ in range(members):
            samples.append(Sample(p, [rng.randrange(50) for _ in range(rng.randint(*response))]))
    rng.shuffle(samples)
    return build_layout(samples, share=kind != "unshared", pad_multiple=pad)


def qkv(layout, hq, hkv, d, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = layout.num_tokens
    make = lambda h: torch.randn(T, h, d, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv)


def run(backend, q, k, v, layout, grad_out):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = get_attention_backend(backend)(q, k, v, layout, q.shape[-1] ** -0.5)
    valid = layout.valid.to(out.device)[:, None, None]
    grads = torch.autograd.grad(out, (q, k, v), grad_out * valid)
    return out, grads


LAYOUTS = [("shared", 1), ("shared", 4), ("groups_of_one", 1), ("groups_of_one", 3), ("unshared", 1), ("unshared", 4)]


# ---- CPU (CI) ------------------------------------------------------------------------------


def test_backends_registered_and_accepted_by_config():
    from ps_bridge.config import PrefixSharingConfig

    for name in ("torch_ref", "flash_atten_gpu", "flash_atten_gpu_expand", "flex", "auto"):
        assert name in BACKENDS
        assert PrefixSharingConfig(backend=name).backend == name


def test_merge_partials_equals_softmax_over_union():
    torch.manual_seed(0)
    T, H, D, ka, kb = 5, 3, 8, 7, 4
    q = torch.randn(T, H, D, dtype=torch.float64)
    k = torch.randn(ka + kb, H, D, dtype=torch.float64)
    v = torch.randn(ka + kb, H, D, dtype=torch.float64)

    def partial(sl):
        s = torch.einsum("thd,khd->htk", q, k[sl])
        return torch.einsum("htk,khd->thd", torch.softmax(s, -1), v[sl]), torch.logsumexp(s, -1)

    out_a, lse_a = partial(slice(0, ka))
    out_b, lse_b = partial(slice(ka, None))
    out_full, lse_full = partial(slice(None))
    out, lse = merge.merge_partials(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_full, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, lse_full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["flash_atten_gpu", "flash_atten_gpu_expand"])
@pytest.mark.parametrize("kind,pad", LAYOUTS)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (2, 2, 128), (4, 1, 256)])
def test_flash_designs_on_cpu_match_reference(backend, kind, pad, hq, hkv, d):
    check_float64_against_reference(backend, make_layout(kind, pad, seed=hq * d + pad), hq, hkv, d)


def check_float64_against_reference(backend, layout, hq, hkv, d, seed=0):
    """Outputs (valid positions) and q/k/v gradients equal torch_ref's in float64 (CPU flash op)."""
    q, k, v = qkv(layout, hq, hkv, d, torch.float64, seed=seed)
    grad_out = torch.randn_like(q)
    out, grads = run(backend, q, k, v, layout, grad_out)
    ref, ref_grads = run("torch_ref", q, k, v, layout, grad_out)
    valid = layout.valid
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-9, atol=1e-9)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)


def test_cascade_backward_from_merged_output_matches_autograd_through_merge():
    """The ring-attention identity on its own: partial backwards fed the merged out/lse, summed,
    equal plain autograd through the two partials and `merge_partials`."""
    layout = make_layout("shared", 2, seed=5)
    q, k, v = qkv(layout, 4, 2, 32, torch.float64, seed=3)
    plan = cascade.cascade_plan(layout)
    kernel = varlen.CpuFlashKernel()
    scale = 32 ** -0.5
    out, lse, aux = cascade.cascade_forward(q, k, v, plan, scale, kernel)
    dout = torch.randn_like(out) * layout.valid[:, None, None]
    dq, dk, dv = cascade.cascade_backward(dout, q, k, v, out, lse, plan, scale, kernel, aux)

    qa, ka, va = (x.clone().requires_grad_(True) for x in (q, k, v))
    [cross] = plan.ancestors  # one level: the responses against the prompts
    e = cross.queries[0]
    assert e == layout.prompt_block_end and cross.keys == (0, e)

    def dense_partial(qs, ks, vs, call):
        # the same partial written with plain differentiable math, one batch element at a time
        outs, lses = [], []
        for b in range(len(call.cu_q) - 1):
            a0, a1, k0, k1 = call.cu_q[b], call.cu_q[b + 1], call.cu_k[b], call.cu_k[b + 1]
            if a1 == a0:
                continue
            kk = ks[k0:k1].repeat_interleave(2, 1)
            vv = vs[k0:k1].repeat_interleave(2, 1)
            s = torch.einsum("thd,khd->htk", qs[a0:a1], kk) * scale
            if call.causal:
                lq, lk = a1 - a0, k1 - k0
                allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
                s = s.masked_fill(~allowed, float("-inf"))
            outs.append(torch.einsum("htk,khd->thd", torch.softmax(s, -1), vv))
            lses.append(torch.logsumexp(s, -1))
        return torch.cat(outs), torch.cat(lses, 1)

    o1, l1 = dense_partial(qa, ka, va, plan.segments)
    o2, l2 = dense_partial(qa[e:], ka[:e], va[:e], cross.call)
    merged, _ = merge.merge_partials(o1[e:], l1[:, e:], o2, l2)
    full = torch.cat([o1[:e], merged])
    torch.testing.assert_close(full, out, rtol=1e-10, atol=1e-10)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(full, (qa, ka, va), dout)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_cascade_copies_no_key_value():
    """The default backend hands the kernel views of the packed K/V, never gathered copies."""

    class Recording(varlen.CpuFlashKernel):
        def __init__(self):
            self.seen = []

        def forward(self, q, k, v, call, scale):
            self.seen.append((k, v))
            return super().forward(q, k, v, call, scale)

    layout = make_layout("shared", 4, seed=2)
    q, k, v = qkv(layout, 4, 2, 16, torch.float32)
    plan = cascade.cascade_plan(layout)
    kernel = Recording()
    cascade.cascade_forward(q, k, v, plan, 0.25, kernel)
    assert len(kernel.seen) == 2
    for kk, vv in kernel.seen:
        assert kk.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        assert vv.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    # the cross call reads exactly the prompts' valid keys: padding is a keys-only batch element
    cross = plan.ancestors[0].call
    read = sum(b - a for a, b, qa, qb in zip(cross.cu_k, cross.cu_k[1:], cross.cu_q, cross.cu_q[1:]) if qb > qa)
    assert read == sum(layout.host["valid_lengths"][: layout.num_prompt_segments])


# ---- the cascade on prefix trees -----------------------------------------------------------------


def tree_layout(seed, pad, min_shared=0):
    from tree_cases import tree_samples

    return build_layout(tree_samples(seed), share="tree", min_shared=min_shared, pad_multiple=pad)


@pytest.mark.parametrize("seed,pad", [(0, 1), (1, 3), (3, 2), (6, 4)])
def test_cascade_on_trees_matches_reference(seed, pad):
    """Random trees (a system prompt shared across prompts, depth up to 5, nodes of 1-3 tokens
    between long ones, samples ending inside nodes, identical samples): outputs and q/k/v gradients
    of the tree cascade (torch's CPU flash op, float64) equal torch_ref's."""
    layout = tree_layout(seed, pad)
    assert layout.tree_depth >= 2
    check_float64_against_reference("flash_atten_gpu", layout, 4, 2, 32, seed=seed)


def test_cascade_on_a_tree_launches_per_distance_and_copies_nothing():
    """Launches grow with the depth (1 + D: a causal call and one per distance to the ancestors), not with
    the node count; every call reads views of the packed q/k/v (no copy); the call of distance k pairs
    each query segment of levels k .. D with its ancestor k levels up, and reads each such ancestor's
    valid keys once (a node's keys are one batch element, whatever its descendants)."""

    class Recording(varlen.CpuFlashKernel):
        def __init__(self):
            self.seen = []

        def forward(self, q, k, v, call, scale):
            self.seen.append((q, k, v, call))
            return super().forward(q, k, v, call, scale)

    layout = tree_layout(3, 2)
    D = layout.tree_depth
    assert D >= 3 and layout.num_segments > 1 + D
    q, k, v = qkv(layout, 4, 2, 16, torch.float32)
    plan = cascade.cascade_plan(layout)
    kernel = Recording()
    cascade.cascade_forward(q, k, v, plan, 0.25, kernel)
    assert plan.num_calls == len(kernel.seen) == 1 + D
    for qq, kk, vv, _ in kernel.seen:
        for view, packed in ((qq, q), (kk, k), (vv, v)):
            assert view.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    host = layout.host
    offsets, valid, parent = host["cu_seqlens_padded"], host["valid_lengths"], host["segment_parent"]
    levels = layout.level_offsets
    assert plan.levels == [(offsets[levels[d]], offsets[levels[d + 1]]) for d in range(1, D + 1)]
    start_of = {offsets[s]: s for s in range(layout.num_segments)}
    for distance, x in enumerate(plan.ancestors, start=1):
        assert x.queries == (offsets[levels[distance]], offsets[-1])
        assert x.keys == (0, offsets[levels[D - distance + 1]])
        call = x.call
        assert call.total_q == x.queries[1] - x.queries[0] and call.cu_k[-1] == x.keys[1] - x.keys[0]
        read = []
        for qa, qb, ka, kb in zip(call.cu_q, call.cu_q[1:], call.cu_k, call.cu_k[1:]):
            if qb == qa:
                continue
            node = start_of[ka + x.keys[0]]
            assert kb - ka == valid[node]  # the node's valid keys
            read.append(node)
            for seg in range(layout.num_segments):  # every query segment of the element: a descendant
                if qa + x.queries[0] <= offsets[seg] < qb + x.queries[0]:
                    up = seg
                    for _ in range(distance):
                        up = parent[up]
                    assert up == node
        assert len(set(read)) == len(read)
        below = {s for s in range(levels[distance], layout.num_segments)}
        with_descendants = set()
        for seg in below:
            up = seg
            for _ in range(distance):
                up = parent[up]
            with_descendants.add(up)
        assert set(read) == with_descendants


def test_cascade_on_a_depth_one_layout_is_the_two_call_cascade():
    layout = make_layout("shared", 4, seed=2)
    plan = cascade.cascade_plan(layout)
    assert plan.num_calls == 2 and len(plan.levels) == 1
    assert plan.levels[0][0] == plan.ancestors[0].queries[0] == layout.prompt_block_end
    assert cascade.cascade_plan(make_layout("unshared", 2)).num_calls == 1


def test_auto_picks_the_cascade_on_trees_where_flash_takes_the_inputs():
    from ps_bridge.kernels.attention import choose_attention_backend

    for depth in (0, 1, 2, 5):
        assert choose_attention_backend(torch.device("cuda"), torch.bfloat16, 128, depth) == "flash_atten_gpu"
        assert choose_attention_backend(torch.device("cuda"), torch.float32, 128, depth) == "torch_ref"
        assert choose_attention_backend(torch.device("cpu"), torch.float64, 64, depth) == "torch_ref"
    layout = tree_layout(0, 1)
    q, k, v = qkv(layout, 2, 1, 8, torch.float32)
    assert torch.equal(BACKENDS["auto"](q, k, v, layout, 0.3), BACKENDS["torch_ref"](q, k, v, layout, 0.3))


@pytest.mark.parametrize("backend", ["flash_atten_gpu_expand", "flash_atten_npu"])
def test_expand_designs_refuse_deeper_trees_naming_the_backend(backend):
    layout = tree_layout(0, 1)
    q = torch.zeros(layout.num_tokens, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"backend '{backend}' runs prefix trees of depth <= 1.*'flash_atten_gpu'"):
        BACKENDS[backend](q, q, q, layout, 1.0)


def test_expand_plan_gathers_prompt_once_per_response():
    layout = make_layout("shared", 1, seed=4)
    plan = expand.expand_plan(layout)
    host = layout.host
    responses = [s for s, p in enumerate(host["segment_is_prompt"]) if not p]
    expected = layout.num_tokens + sum(host["valid_lengths"][host["segment_group"][s]] for s in responses)
    assert len(plan.key_rows_host) == expected


@pytest.mark.parametrize("kind,pad", [("shared", 1), ("shared", 4), ("unshared", 2)])
def test_flex_mask_on_cpu_matches_reference(kind, pad):
    pytest.importorskip("torch.nn.attention.flex_attention")
    layout = make_layout(kind, pad, seed=7)
    q, k, v = qkv(layout, 4, 2, 16, torch.float32)
    out = BACKENDS["flex"](q, k, v, layout, 0.25)
    ref = BACKENDS["torch_ref"](q, k, v, layout, 0.25)
    torch.testing.assert_close(out[layout.valid], ref[layout.valid], rtol=1e-5, atol=1e-5)


def test_bucket_lengths_are_few_and_cover():
    assert bucket_length(1) == 256
    seen = set()
    for n in range(1, 70000, 37):
        b = bucket_length(n)
        assert b >= n and b <= max(256, int(n * 1.25) + 1)
        seen.add(b)
    assert len(seen) <= 4 * 9 + 1  # four buckets per power of two


def test_flash_kernels_are_not_claimed_for_cpu_or_float32():
    x = torch.zeros(4, 2, 64)
    assert not varlen.flash_supports(x)
    assert not varlen.flash_supports(x.bfloat16())  # CPU


def test_auto_is_torch_ref_on_cpu():
    layout = make_layout("shared", 1)
    q, k, v = qkv(layout, 2, 1, 8, torch.float32)
    assert torch.equal(BACKENDS["auto"](q, k, v, layout, 0.3), BACKENDS["torch_ref"](q, k, v, layout, 0.3))


def test_varlen_call_rejects_inconsistent_batches():
    with pytest.raises(ValueError, match="more queries than keys"):
        varlen.VarlenCall(cu_q=[0, 5], cu_k=[0, 3], causal=True)
    with pytest.raises(ValueError, match="no keys"):
        varlen.VarlenCall(cu_q=[0, 2], cu_k=[0, 0], causal=False)


def plain_row_logprobs(logits, layout):
    """The definition, by autograd: each row's log-softmax at its packed position, at its label."""
    picked = logits.index_select(0, layout.row_source)
    label = layout.row_label
    target = picked.gather(1, label.clamp(min=0)[:, None])[:, 0]
    return torch.where(label >= 0, target - torch.logsumexp(picked, dim=-1), torch.zeros_like(target))


@pytest.mark.parametrize("chunk_rows", [5, 1024])
def test_row_logprobs_match_the_definition(chunk_rows):
    layout = make_layout("shared", 3, seed=9)
    torch.manual_seed(0)
    logits = torch.randn(layout.num_tokens, 64, dtype=torch.float64, requires_grad=True)
    rows_ref = plain_row_logprobs(logits, layout)
    rows = PackedRows(layout).logprobs(logits, chunk_rows=chunk_rows)
    torch.testing.assert_close(rows.double(), rows_ref.double(), rtol=0, atol=1e-6)
    g = torch.randn_like(rows_ref)
    (ga,) = torch.autograd.grad(rows_ref, logits, g)
    (gb,) = torch.autograd.grad(rows, logits, g)
    torch.testing.assert_close(gb, ga, rtol=0, atol=1e-6)


# ---- GPU (H200) ------------------------------------------------------------------------------

# (query heads, key/value heads, head dim): grouped-query attention at the head dims of Qwen2.5 (128)
# and of Qwen3.5's attention layers (256). FlexAttention compiles forward and backward for each one
# (four shapes took 88 s on the H200, BENCHMARKS.md), so the GPU part keeps two; the CPU tests above
# also run head dim 64 and hq == hkv, and tests/test_bf16_vs_fp32_gpu.py runs every GPU backend
# inside a model.
HEAD_CONFIGS = [(8, 2, 128), (8, 1, 256)]


def rel_err(x, ref):
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-12))


def check_bf16_against_fp32_reference(backend, layout, hq, hkv, d):
    q, k, v = qkv(layout, hq, hkv, d, torch.bfloat16, device="cuda")
    grad_out = torch.randn(q.shape, dtype=torch.bfloat16, device="cuda")
    out, grads = run(backend, q, k, v, layout, grad_out)
    ref, ref_grads = run("torch_ref", q.float(), k.float(), v.float(), layout, grad_out.float())
    assert out.dtype == torch.bfloat16
    valid = layout.valid
    assert torch.isfinite(out[valid]).all()
    assert rel_err(out[valid], ref[valid]) < 1e-2, rel_err(out[valid], ref[valid])
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, r) < 2e-2, (name, rel_err(g, r))


def gpu_layout(kind, pad, seed):
    return make_layout(kind, pad, seed=seed, prompt=(50, 400), response=(1, 300), groups=3, n=(2, 6)).to("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_atten_gpu", "flash_atten_gpu_expand"])
@pytest.mark.parametrize("kind,pad", [("shared", 1), ("shared", 8), ("groups_of_one", 1), ("unshared", 8)])
@pytest.mark.parametrize("hq,hkv,d", HEAD_CONFIGS)
def test_gpu_flash_bf16_matches_fp32_reference(backend, kind, pad, hq, hkv, d):
    check_bf16_against_fp32_reference(backend, gpu_layout(kind, pad, seed=d + pad), hq, hkv, d)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", HEAD_CONFIGS)
def test_gpu_cascade_on_trees_bf16_matches_fp32_reference(hq, hkv, d):
    """The tree cascade on the GPU's flash kernels (bf16) against the float32 reference: a tree of
    depth >= 3 mixing long nodes (a system prompt, a search tree) with nodes of 1-3 tokens."""
    from test_bf16_vs_fp32_gpu import gpu_tree_samples

    layout = build_layout(gpu_tree_samples(50, seed=d), share="tree", min_shared=0, pad_multiple=8).to("cuda")
    assert layout.tree_depth >= 3
    check_bf16_against_fp32_reference("flash_atten_gpu", layout, hq, hkv, d)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", HEAD_CONFIGS)
def test_gpu_flex_bf16_matches_fp32_reference(hq, hkv, d):
    # one layout per head configuration: each new shape compiles FlexAttention forward and backward
    check_bf16_against_fp32_reference("flex", gpu_layout("shared", 8, seed=11), hq, hkv, d)


@pytest.mark.gpu
def test_gpu_auto_is_the_cascade():
    from ps_bridge.kernels.attention.kernel_choice import kernel_for

    layout = gpu_layout("shared", 1, seed=3)
    q, k, v = qkv(layout, 4, 2, 64, torch.bfloat16, device="cuda")
    assert torch.equal(BACKENDS["auto"](q, k, v, layout, 0.125), BACKENDS["flash_atten_gpu"](q, k, v, layout, 0.125))
    assert kernel_for(q.device).name in ("torch", "flash_attn", "cudnn+torch", "cudnn+flash_attn")


@pytest.mark.gpu
def test_gpu_float32_goes_to_reference_under_auto_and_is_refused_by_flash():
    layout = gpu_layout("shared", 1, seed=4)
    q, k, v = qkv(layout, 4, 2, 64, torch.float32, device="cuda")
    assert torch.equal(BACKENDS["auto"](q, k, v, layout, 0.125), BACKENDS["torch_ref"](q, k, v, layout, 0.125))
    with pytest.raises(ValueError, match="float16/bfloat16"):
        BACKENDS["flash_atten_gpu"](q, k, v, layout, 0.125)


@pytest.mark.gpu
def test_gpu_flex_reuses_compiled_kernel_across_lengths_in_a_bucket():
    from torch._dynamo.utils import counters

    lengths, compiled_frames = [], []
    for seed in range(4):
        layout = make_layout("shared", 1, seed=seed, prompt=(300, 320), response=(100, 110), groups=2, n=(3, 3)).to("cuda")
        lengths.append(bucket_length(layout.num_tokens))
        q, k, v = qkv(layout, 4, 2, 64, torch.bfloat16, device="cuda")
        BACKENDS["flex"](q, k, v, layout, 0.125)
        compiled_frames.append(counters["frames"]["ok"])
    assert len(set(lengths)) == 1
    assert compiled_frames[0] > 0, "FlexAttention ran uncompiled (TORCHDYNAMO_DISABLE not lifted?)"
    # the first micro-batch compiles; the next ones (other lengths, same bucket) reuse it
    assert compiled_frames[1] == compiled_frames[-1], compiled_frames
