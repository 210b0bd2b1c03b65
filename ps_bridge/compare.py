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

from ps_bridge.layout import Sample
from ps_bridge.logprobs import response_logprobs
from ps_bridge.runtime import LoadedModel, make_layout, row_logprobs


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
    """Forward (and backward) of `sum_i sum_j w_ij * logp_ij` over the response tokens."""
    model = loaded.model
    model.zero_grad(set_to_none=True)
    layout = make_layout(samples, loaded, share=share)
    weights = loss_weights(samples, seed)
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        rows = row_logprobs(loaded, layout)
        per_sample = response_logprobs(rows, layout.to(rows.device))
        if backward:
            loss = sum((w.to(lp.device) * lp).sum() for w, lp in zip(weights, per_sample))
            loss.backward()
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = {}
    if backward:
        grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    return RunResult(
        logprobs=[lp.detach().float().cpu() for lp in per_sample],
        grads=grads,
        seconds=seconds,
        tokens=layout.tokens_shared,
    )


def max_abs_diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def max_relative_grad_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """max over parameters of ||a - b|| / ||b|| (parameters with a zero reference gradient are
    compared absolutely)."""
    if set(a) != set(b):
        raise ValueError(f"gradient sets differ: {sorted(set(a) ^ set(b))}")
    worst = 0.0
    for name in a:
        ref = b[name].norm()
        diff = (a[name] - b[name]).norm()
        worst = max(worst, float(diff / ref) if ref > 0 else float(diff))
    return worst


def hf_logprobs(hf_model, samples: List[Sample]) -> List[torch.Tensor]:
    from ps_bridge.testing import hf_sample_logprobs

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
