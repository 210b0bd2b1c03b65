"""Shared vs unshared vs Hugging Face: the comparison the demo prints and the tests assert.

One log-prob loss (a fixed random weight per response token) is run forward and backward once
prefix-shared and once unshared on the same model; the parameter gradients of the two must agree,
and both runs' log-probs must agree with Hugging Face's own model on the same weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ps_bridge.layout import Sample, build_layout
from ps_bridge.parallel.gradients import hf_named_gradients
from ps_bridge.parallel.groups import max_over_ranks
from ps_bridge.tools.runtime import LoadedModel
from ps_bridge.tools.schedule import logprob_pass
from ps_bridge.tools.tiny_checkpoints import hf_sample_logprobs


def loss_weights(samples: List[Sample], seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(len(s.response), generator=g) + 0.5 for s in samples]


@dataclass
class RunResult:
    logprobs: List[torch.Tensor]  # per sample, response tokens, float32 on CPU
    grads: Dict[str, torch.Tensor]
    seconds: float
    tokens: int


def run_logprob_loss(loaded: LoadedModel, samples: List[Sample], share: bool, backward: bool = True, seed: int = 0) -> RunResult:
    """Forward (and backward) of `sum_i sum_j w_ij * logp_ij` over the response tokens, as one
    micro-batch through megatron's schedule (any TP / SP / PP). Gradients are this rank's shards."""
    model = loaded.model
    model.zero_grad(set_to_none=True)
    weights = loss_weights(samples, seed)
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        [per_sample] = logprob_pass(loaded, [samples], share=share, loss_weights=[weights] if backward else None)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = {}
    if backward:
        grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    return RunResult(
        logprobs=per_sample,
        grads=grads,
        seconds=seconds,
        tokens=build_layout(samples, share=loaded.config.layout_share(share), min_shared=loaded.config.tree_min_shared,
                            max_depth=loaded.config.tree_max_depth).tokens_shared,
    )


def max_abs_diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def total_relative_grad_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| with all parameters' gradients as one vector (float64 sums). Steadier than
    the per-parameter maximum when a small parameter's gradient is rounding-dominated (bf16, TF32)."""
    if set(a) != set(b):
        raise ValueError(f"gradient sets differ: {sorted(set(a) ^ set(b))}")
    diff_sq = sum(float((a[n].double() - b[n].double()).norm() ** 2) for n in b)
    ref_sq = sum(float(b[n].double().norm() ** 2) for n in b)
    return (diff_sq / ref_sq) ** 0.5


def max_relative_grad_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """max over parameters of ||a - b|| / ||b|| (parameters with a zero reference gradient are
    compared absolutely). Under TP / PP each rank compares its own shards; the worst rank counts."""
    if set(a) != set(b):
        raise ValueError(f"gradient sets differ: {sorted(set(a) ^ set(b))}")
    worst = 0.0
    for name in a:
        ref = b[name].norm()
        diff = (a[name] - b[name]).norm()
        worst = max(worst, float(diff / ref) if ref > 0 else float(diff))
    return max_over_ranks(worst)


def hf_logprobs(hf_model, samples: List[Sample]) -> List[torch.Tensor]:
    with torch.no_grad():
        return hf_sample_logprobs(hf_model, samples)


def compare(loaded: LoadedModel, samples: List[Sample], hf_model: Optional[torch.nn.Module] = None) -> dict:
    shared = run_logprob_loss(loaded, samples, share=True)
    unshared = run_logprob_loss(loaded, samples, share=False)
    result = dict(
        samples=len(samples),
        tokens_unshared=unshared.tokens,
        tokens_shared=shared.tokens,
        ideal_ratio=unshared.tokens / shared.tokens,
        max_logprob_diff_shared_vs_unshared=max_abs_diff(shared.logprobs, unshared.logprobs),
        max_rel_grad_diff_shared_vs_unshared=max_relative_grad_diff(shared.grads, unshared.grads),
        seconds_shared=shared.seconds,
        seconds_unshared=unshared.seconds,
    )
    if hf_model is not None:
        ref = hf_logprobs(hf_model, samples)
        result["max_logprob_diff_shared_vs_hf"] = max_abs_diff(shared.logprobs, ref)
        result["max_logprob_diff_unshared_vs_hf"] = max_abs_diff(unshared.logprobs, ref)
    return result


def hf_gradient_difference(loaded: LoadedModel, hf_model: torch.nn.Module, samples: List[Sample], seed: int = 0) -> dict:
    """Prefix-shared gradients of the log-prob loss against Hugging Face's for the same loss, for
    every HF parameter, matched by name through Megatron-Bridge's export (fused QKV, gated MLP,
    GDN projections split back). Returns the relative difference (norm of the difference over the
    norm of HF's gradient) per parameter HF gives a non-zero gradient, their maximum, and the max
    absolute gradient among the rest (parameters the loss does not reach, e.g. a vision tower)."""
    shared = run_logprob_loss(loaded, samples, share=True, seed=seed)
    for name, p in loaded.model.named_parameters():
        grad = shared.grads.get(name)
        p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype)
    try:
        ours = hf_named_gradients(loaded.bridge, loaded.model)
    finally:
        loaded.model.zero_grad(set_to_none=True)

    hf_model.zero_grad(set_to_none=True)
    hf_lps = hf_sample_logprobs(hf_model, samples)
    sum((w * lp).sum() for w, lp in zip(loss_weights(samples, seed), hf_lps)).backward()
    reference = {n: p.grad for n, p in hf_model.named_parameters()}
    hf_model.zero_grad(set_to_none=True)

    for name, ref in reference.items():
        if name not in ours and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            ours[name] = _fused_expert_gradient(ours, name, ref.shape[0])
    missing = sorted(n for n, g in reference.items() if g is not None and n not in ours)
    if missing:
        raise ValueError(f"HF parameters with gradients but no exported counterpart: {missing}")
    per_parameter: Dict[str, float] = {}
    worst_unreached = 0.0
    for name, ref in reference.items():
        if name not in ours:
            continue
        if ref is None or ref.norm() == 0:
            worst_unreached = max(worst_unreached, float(ours[name].abs().max()))
            continue
        per_parameter[name] = float((ours[name] - ref.float()).norm() / ref.float().norm())
    return dict(
        max_rel_grad_diff_vs_hf=max(per_parameter.values()),
        per_parameter=per_parameter,
        max_abs_grad_unreached=worst_unreached,
        parameters_compared=len(per_parameter),
    )


def _fused_expert_gradient(per_expert: Dict[str, torch.Tensor], name: str, num_experts: int) -> torch.Tensor:
    """transformers keeps MoE experts as fused `[E, ...]` parameters while Megatron-Bridge exports
    them per expert (the checkpoint's names): stack the exported ones into the fused layout
    (`gate_up_proj[e] = cat(gate_proj_e, up_proj_e)`, `down_proj[e] = down_proj_e`)."""
    prefix = name.rsplit(".", 1)[0]
    if name.endswith("gate_up_proj"):
        parts = [torch.cat([per_expert[f"{prefix}.{e}.gate_proj.weight"], per_expert[f"{prefix}.{e}.up_proj.weight"]]) for e in range(num_experts)]
    else:
        parts = [per_expert[f"{prefix}.{e}.down_proj.weight"] for e in range(num_experts)]
    return torch.stack(parts)
