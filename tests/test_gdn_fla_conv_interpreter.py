"""fla's causal conv kernel, run on the CPU by Triton's interpreter, against `torch_ref`.

The prefix-shared conv is one varlen call in which each response starts from a conv state that we
build ourselves (its prompt's last W inputs, `GDNPlan.conv_tail_index`), so our state layout must be
fla's: `[N, D, W]`, column W-1 the newest input, column 0 unread. Triton's interpreter
(`TRITON_INTERPRET=1`) runs fla's own Triton kernel on CPU tensors, so CI checks this without a GPU:
forward, final states and every gradient (the initial-state gradient is what carries a response's
conv gradient back into its prompt); and a level-bucketed layout's conv (filler sequences, some of
them empty; offsets on the device only and our chunk index). Autotuning cannot benchmark in the interpreter, so the child
process takes each kernel's first config. fla's chunked delta-rule kernels do not run in the
interpreter; they are checked on the GPU (tests/test_gdn_fla_gpu.py).
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

pytest.importorskip("fla")
pytest.importorskip("triton")
sys.path.insert(0, os.path.dirname(__file__))
from triton_interpreter import run_interpreted  # noqa: E402

CHILD = textwrap.dedent(
    """
    from triton.runtime import autotuner

    _run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):  # the interpreter cannot time configs
        self.configs = self.configs[:1]
        return _run(self, *args, **kwargs)

    autotuner.Autotuner.run = first_config

    from gdn_cases import make_case, packed_inputs, sample_outputs
    from ps_bridge.kernels.gdn import GDN_BACKENDS, forked_causal_conv1d, plan_from_layout
    from ps_bridge.kernels.gdn import fla as fla_backend, torch_ref
    from ps_bridge.kernels.gdn.plan import bucketed_conv_tails
    from ps_bridge.layout import build_layout

    # 1. the raw op: per-sequence initial states in, final states out
    gen = torch.Generator().manual_seed(0)
    D, W = 8, 4
    cu_host = [0, 5, 7, 14, 15, 18]  # lengths 5, 2, 7, 1, 3: some shorter than W
    x = torch.randn(cu_host[-1], D, generator=gen).requires_grad_(True)
    w = torch.randn(D, W, generator=gen).requires_grad_(True)
    b = torch.randn(D, generator=gen).requires_grad_(True)
    h0 = torch.randn(len(cu_host) - 1, D, W, generator=gen).requires_grad_(True)
    runs = {}
    for name, backend in (("ref", torch_ref), ("fla", fla_backend)):
        y, final = backend.causal_conv1d(x, w, b, torch.tensor(cu_host), cu_host, h0, True, "silu")
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        runs[name] = (y, final, torch.autograd.grad((y * dy).sum(), [x, w, b, h0]))
    (y_r, f_r, g_r), (y_f, f_f, g_f) = runs["ref"], runs["fla"]
    result["op_output"] = rel(y_f, y_r)
    result["op_final_state"] = rel(f_f[..., 1:], f_r[..., 1:])  # column 0 is never read
    result["op_grads"] = max(rel(a, c) for a, c in zip(g_f, g_r))

    # 2. the prefix-shared conv of a packed layout (groups of 3, 1 and 2, a 1-token prompt, padding)
    #    against torch_ref on the same plan, and against fla's own unshared run, sample by sample
    case = make_case(seed=3, group_sizes=(3, 1, 2), prompt_lens=(7, 1, 11), dtype=torch.float32)

    def conv(layout, backend):
        plan = plan_from_layout(layout)
        mixed, _, _ = packed_inputs(case, layout, pad_value=0.0)
        compact = mixed.index_select(0, plan.gather_index) if plan.gather_index is not None else mixed
        tails = bucketed_conv_tails(layout, case.conv_weight.shape[1], mixed.device) if layout.bucketed else None
        y = forked_causal_conv1d(compact, case.conv_weight, case.conv_bias, plan, GDN_BACKENDS[backend], tails=tails)
        if plan.gather_index is not None:
            y = y.new_zeros(plan.num_input_tokens, y.shape[1]).index_copy(0, plan.gather_index, y)
        per_sample = sample_outputs(y, layout)
        weights = torch.Generator().manual_seed(2)
        loss = sum((o * torch.randn(o.shape, generator=weights)).sum() for o in per_sample)
        return torch.cat(per_sample), torch.autograd.grad(loss, case.leaves(), allow_unused=True)

    shared = build_layout(case.samples, share=True, pad_multiple=4)
    unshared = build_layout(case.samples, share=False, pad_multiple=4)
    (y_f, g_f), (y_r, g_r), (y_u, g_u) = conv(shared, "fla"), conv(shared, "torch_ref"), conv(unshared, "fla")
    result["forked_vs_torch_ref_output"] = rel(y_f, y_r)
    result["forked_vs_torch_ref_grads"] = max(rel(a, c) for a, c in zip(g_f, g_r) if c is not None)
    result["forked_vs_unshared_output"] = rel(y_f, y_u)
    result["forked_vs_unshared_grads"] = max(rel(a, c) for a, c in zip(g_f, g_u) if c is not None)

    # 3. level buckets: each level as its segments and filler sequences (zero-length ones among them),
    #    fla given the offsets on the device only and our chunk index, against torch_ref and unshared
    level = build_layout(case.samples, share=True, bucket=True, level_buckets=True)
    plan = plan_from_layout(level)
    assert plan.cu_all_host is None and 0 in torch.diff(plan.cu_all).tolist()
    (y_f, g_f), (y_r, g_r) = conv(level, "fla"), conv(level, "torch_ref")
    result["level_vs_torch_ref_output"] = rel(y_f, y_r)
    result["level_vs_torch_ref_grads"] = max(rel(a, c) for a, c in zip(g_f, g_r) if c is not None)
    result["level_vs_unshared_output"] = rel(y_f, y_u)
    result["level_vs_unshared_grads"] = max(rel(a, c) for a, c in zip(g_f, g_u) if c is not None)
    """
)


def test_fla_conv_state_layout_and_forked_conv_match_torch_ref():
    result = run_interpreted(CHILD)
    for key, value in result.items():
        assert value < 1e-5, (key, value)
