"""Helpers shared by the Qwen3.5 model tests: load tiny checkpoints, compare runs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import load_file

from ps_bridge.layout import build_layout
from ps_bridge.rows import PackedRows
from ps_bridge.tools.runtime import forward_logits, load_model
from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS, grpo_like_samples


def skip_where_vl_refused():
    """Skip a Qwen3.5 ConditionalGeneration (VL) test where our compat layer refuses that model
    (`ps_bridge.compat.megatron_bridge.vl_refusal`: Megatron-Bridge < 0.6.0), with the refusal as the
    reason; tests/test_stack_refusals.py checks the refusal itself."""
    from ps_bridge.compat.megatron_bridge import vl_refusal

    refusal = vl_refusal()
    if refusal:
        pytest.skip(f"refused by ps_bridge.compat.megatron_bridge.vl_refusal: {refusal}")


@contextlib.contextmanager
def cuda_op_formulas_on_cpu():
    """The element-wise ops' CUDA paths on the CPU: the norms' `row_norm.RowNorm` and the gates'
    `triton_gates.Gates` with the formulas their Triton kernels compute (`rms_norm._backward`, ...) in place
    of the kernels (tests/test_row_norm_interpreter.py runs the kernels against the same formulas), and the
    MoE SwiGLU's `CompiledOp` with its plain forward and backward functions in place of the compiled ones."""
    from ps_bridge.kernels import backend, rms_norm, row_norm, weighted_swiglu
    from ps_bridge.kernels.gdn import inputs, triton_gates

    def forward(x, weight, gate, eps, mean, zero_centered):
        if not mean:
            return inputs.naive_l2_normalize(x, eps)
        if gate is None:
            return rms_norm.naive(x, weight, eps, zero_centered)
        return rms_norm.naive_gated(x, weight, gate, eps, zero_centered)

    def backward(grad, x, weight, gate, eps, mean, zero_centered):
        if not mean:
            return inputs._l2_backward(grad, x, eps)[0], None, None
        if gate is None:
            return (*rms_norm._backward(grad, x, weight, eps, zero_centered), None)
        return rms_norm._gated_backward(grad, x, weight, gate, eps, zero_centered)

    ops = (weighted_swiglu.fused,)
    saved = (backend.COMPILED_DEVICES, row_norm.usable, row_norm.forward, row_norm.backward, triton_gates.usable,
             triton_gates.forward, triton_gates.backward)
    backend.COMPILED_DEVICES = ("cuda", "cpu")
    row_norm.usable, row_norm.forward, row_norm.backward = (lambda x: True), forward, backward
    triton_gates.usable, triton_gates.forward = (lambda alpha, A_log: True), inputs.naive_gates
    triton_gates.backward = inputs._gates_backward
    for op in ops:
        op.__dict__["compiled"] = op._functions  # the cached_property's slot
    try:
        yield
    finally:
        (backend.COMPILED_DEVICES, row_norm.usable, row_norm.forward, row_norm.backward, triton_gates.usable,
         triton_gates.forward, triton_gates.backward) = saved
        for op in ops:
            op.__dict__.pop("compiled", None)


def load_tiny(name, tmp_path_factory, seed=0):
    if name.endswith("-vl"):
        skip_where_vl_refused()
    path = str(tmp_path_factory.mktemp(name.replace(".", "_")))
    hf = TINY_BUILDERS[name](path, seed=seed)
    loaded = load_model(path)
    return hf, loaded, path


def samples_for(loaded, **kw):
    args = dict(num_prompts=3, n=3, prompt_len=(5, 13), response_len=(1, 7), seed=0)
    args.update(kw)
    # stay below the tiny VL checkpoints' image/video/vision special ids (250..253)
    return grpo_like_samples(min(loaded.vocab_size, 248), **args)


def layout_for(loaded, samples, share, pad_multiple=1):
    """`share`: True (one level), False or "tree" (sharing every common run: min_shared 0)."""
    return build_layout(samples, share=share, pad_multiple=pad_multiple, vocab_size=loaded.vocab_size,
                        min_shared=0).to(loaded.device)


def max_logit_diff_unshared_vs_hf(loaded, hf, samples) -> float:
    """Largest |logit - HF logit| over the unshared pack of `samples` (one HF call per sequence)."""
    layout = layout_for(loaded, samples, share=False)
    worst = 0.0
    with torch.no_grad():
        logits = forward_logits(loaded, layout)
        for s in range(layout.num_segments):
            a, b = layout.host["cu_seqlens_padded"][s], layout.host["cu_seqlens_padded"][s + 1]
            worst = max(worst, (logits[a:b] - hf(layout.tokens[a:b].unsqueeze(0)).logits[0]).abs().max().item())
    return worst


def per_sample_response_logprobs(loaded, samples, share, pad_multiple=1):
    layout = layout_for(loaded, samples, share, pad_multiple)
    rows = PackedRows.of(layout)
    return rows.responses(rows.logprobs(forward_logits(loaded, layout)))


def float64_response_logprobs(loaded, samples, share, pad_multiple=1):
    """`per_sample_response_logprobs` with the log-softmax in float64 (the library's rows are
    float32): for finite differences on a float64 model."""
    layout = layout_for(loaded, samples, share, pad_multiple)
    logits = forward_logits(loaded, layout).double()
    picked = logits.index_select(0, layout.row_source)
    label = layout.row_label
    target = picked.gather(1, label.clamp(min=0)[:, None])[:, 0]
    rows = torch.where(label >= 0, target - torch.logsumexp(picked, dim=-1), torch.zeros_like(target))
    return PackedRows.of(layout).responses(rows)


def max_abs(xs, ys):
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(xs, ys))


def param_grads(loaded, samples, share, weights, pad_multiple=1):
    """Gradients of sum_i <weights_i, response log-probs_i> for every parameter."""
    model = loaded.model
    model.zero_grad(set_to_none=True)
    lps = per_sample_response_logprobs(loaded, samples, share, pad_multiple)
    loss = sum((lp * w).sum() for lp, w in zip(lps, weights))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def export_matches_checkpoint(loaded, path):
    """(exported names == checkpoint names, max abs difference over all tensors)."""
    reference = load_file(f"{path}/model.safetensors")
    exported = {name: t for name, t in loaded.bridge.export_hf_weights([loaded.model], cpu=True, show_progress=False)}
    diff = max((exported[k].float() - reference[k].float()).abs().max().item() for k in reference if k in exported)
    return set(exported) == set(reference), diff, set(reference) ^ set(exported)
