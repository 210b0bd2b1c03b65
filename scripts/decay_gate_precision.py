"""Where the Qwen3.5 GDN decay-gate gradients of transformers and ours differ (docs/gate_findings.md).

Runs on CPU in about half a minute. One tiny Qwen3.5 checkpoint, the log-prob loss of
`ps_bridge.tools.compare` (a weight per response token), the gradients of every parameter from:

- transformers as the tests run it (float32; its chunked torch gated delta rule),
- transformers in float64 with the same chunked rule (the rule still casts to float32 inside),
- transformers truly in float64: every float32 cast of its GDN path made float64 by a proxy of
  `torch` in its module namespace (an experiment only; its code is unchanged),
- transformers in float32 with its token-by-token torch rule (`torch_recurrent_gated_delta_rule`),
- ours (Megatron, prefix-shared and unshared) in float32 and float64 (megatron's attention output
  gate in float64 for the latter; its rotary tables stay float32, which HF's float64 run does not),

each compared (norm of the difference over the norm, per parameter, worst over the decay-gate
parameters and over all others) with the truly float64 transformers run, whose decay-gate entries
are checked against central finite differences first.

    python scripts/decay_gate_precision.py
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import types

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]  # this checkout's ps_bridge, not an installed one

import torch  # noqa: E402
import transformers.models.qwen3_5.modeling_qwen3_5 as hf_qwen35  # noqa: E402

from ps_bridge.tools.compare import loss_weights  # noqa: E402
from ps_bridge.parallel.gradients import hf_named_gradients  # noqa: E402
from ps_bridge.tools.runtime import load_model  # noqa: E402
from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen35, grpo_like_samples  # noqa: E402

GATE = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")


class _Torch64(types.ModuleType):
    """`torch`, except that `torch.float32` is float64 (for transformers' module namespace)."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


class hf_truly_float64:
    """Every float32 cast in transformers' Qwen3.5 made float64 while active: `torch.float32` in its
    module and `Tensor.float()` (g's `A_log.float()`, the rule's casts, the rotary tables)."""

    def __enter__(self):
        self._torch, self._float = hf_qwen35.torch, torch.Tensor.float
        hf_qwen35.torch = _Torch64("torch")
        torch.Tensor.float = lambda t, *a, **k: t.double()

    def __exit__(self, *exc):
        hf_qwen35.torch, torch.Tensor.float = self._torch, self._float


def _recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **_):
    return hf_qwen35.torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)


def float64_attention_gate():
    """megatron-core's attention output gate takes its sigmoid in float32 whatever the dtype; take
    it in float32 at least (as tests/test_qwen35_model.py does for its float64 runs)."""
    from megatron.core.transformer.attention import Attention

    def output_gate(self, x, gate):
        acc = torch.promote_types(x.dtype, torch.float32)
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).to(acc))).to(x.dtype)

    Attention._apply_output_gate = output_gate


def set_rule(model, rule):
    for m in model.modules():
        if isinstance(m, hf_qwen35.Qwen3_5GatedDeltaNet):
            m.chunk_gated_delta_rule = rule


def hf_loss(model, samples, weights):
    total = 0
    for s, w in zip(samples, weights):
        ids = torch.tensor([list(s.prompt) + list(s.response)])
        lp = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)
        P = len(s.prompt)
        total = total + (w.double() * lp[P - 1 : -1].gather(1, ids[0, P:, None])[:, 0]).sum()
    return total


def hf_grads(model, samples, weights):
    model.zero_grad(set_to_none=True)
    hf_loss(model, samples, weights).backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def our_grads(loaded, samples, weights, share):
    from qwen35_helpers import float64_response_logprobs

    loaded.model.zero_grad(set_to_none=True)
    lps = float64_response_logprobs(loaded, samples, share)
    sum((w.double() * lp).sum() for w, lp in zip(weights, lps)).backward()
    grads = {n: g.double() for n, g in hf_named_gradients(loaded.bridge, loaded.model).items()}
    loaded.model.zero_grad(set_to_none=True)
    return grads


def worst(grads, ref):
    rel = {n: float((grads[n] - ref[n]).norm() / ref[n].norm()) for n in ref if ref[n].norm() > 0}
    return max(v for n, v in rel.items() if n.endswith(GATE)), max(v for n, v in rel.items() if not n.endswith(GATE))


def main():
    import ps_bridge.models.gdn

    print("ps_bridge models from", os.path.dirname(ps_bridge.models.gdn.__file__))
    path = tempfile.mkdtemp(prefix="decay_gate_")
    hf = build_tiny_qwen35(path, seed=0)
    samples = grpo_like_samples(248, num_prompts=2, n=3, prompt_len=(5, 13), response_len=(1, 7), seed=0)
    weights = loss_weights(samples)
    hf64 = copy.deepcopy(hf).double()

    with hf_truly_float64():
        truth = hf_grads(hf64, samples, weights)
        params = dict(hf64.named_parameters())
        worst_fd = 0.0
        with torch.no_grad():
            for layer in (0, 1, 3):
                for pname in ("A_log", "dt_bias"):
                    name = f"model.layers.{layer}.linear_attn.{pname}"
                    flat = params[name].view(-1)
                    for i in range(flat.numel()):
                        x, h = flat[i].item(), 1e-5
                        flat[i] = x + h
                        up = hf_loss(hf64, samples, weights).item()
                        flat[i] = x - h
                        down = hf_loss(hf64, samples, weights).item()
                        flat[i] = x
                        worst_fd = max(worst_fd, abs((up - down) / (2 * h) - truth[name][i].item()))
    print(f"reference: transformers truly float64; max |autograd - central FD| over the A_log/dt_bias entries {worst_fd:.1e}")
    print(f"{'gradients':58s} {'decay gate':>10s} {'all others':>10s}   (max relative difference to the reference)")

    rows = [("transformers float32, chunked rule (the tests' HF run)", hf_grads(hf, samples, weights))]
    rows.append(("transformers float64, chunked rule (float32 inside)", hf_grads(hf64, samples, weights)))
    set_rule(hf, _recurrent)
    rows.append(("transformers float32, token-by-token rule", hf_grads(hf, samples, weights)))
    for dtype in (torch.float32, torch.float64):
        if dtype == torch.float64:
            float64_attention_gate()
        loaded = load_model(path, dtype=dtype)
        for share in (True, False):
            label = f"ours {str(dtype).replace('torch.', '')}, {'prefix-shared' if share else 'unshared'}"
            rows.append((label, our_grads(loaded, samples, weights, share)))
    for label, grads in rows:
        gate, others = worst(grads, truth)
        print(f"{label:58s} {gate:10.2e} {others:10.2e}")


if __name__ == "__main__":
    main()
