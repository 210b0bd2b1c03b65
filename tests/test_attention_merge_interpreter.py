"""The fused partial-merge kernel (`ps_bridge.kernels.attention.merge`), run on the CPU by Triton's
interpreter (`TRITON_INTERPRET=1`, in a child process), against the torch reference `merge_all`:

1. the raw kernel, two and three partials, float32 and bfloat16, a head dim that is not a power of
   two, a token count that is not a multiple of the kernel's block: it writes the merged output and
   log-sum-exp into a slice of a larger packed output (the cascade's `out[qs:qe]`, `lse[:, qs:qe]`)
   and leaves the rows around it alone; a partial with rows that see no key (log-sum-exp -inf);
2. the cascade through it (a one-level pack: 2 partials per level; a depth-two tree: 3 at its deepest
   level), outputs and q/k/v gradients against `torch_ref`. On the GPU the same kernel serves every
   bf16 attention layer (tests/test_attention_backends.py's GPU part, tests/test_bf16_vs_fp32_gpu.py).
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

pytest.importorskip("triton")
sys.path.insert(0, os.path.dirname(__file__))
from triton_interpreter import run_interpreted  # noqa: E402

CHILD = textwrap.dedent(
    """
    from ps_bridge.kernels.attention import get_attention_backend, merge
    from ps_bridge.layout import Sample, build_layout

    g = torch.Generator().manual_seed(0)
    T, H, D, before, after = 37, 3, 80, 5, 4
    for dtype in (torch.float32, torch.bfloat16):
        for parts in (2, 3):
            full = torch.randn(before + T + after, H, D, generator=g).to(dtype)
            full_lse = torch.randn(H, before + T + after, generator=g) * 3
            outs = [torch.randn(T, H, D, generator=g).to(dtype) for _ in range(parts - 1)]
            lses = [torch.randn(H, T, generator=g) * 3 for _ in range(parts - 1)]
            lses[0][1, :7] = float("-inf")  # rows of one head that see no key of this partial
            ref, ref_lse = merge.merge_all([full[before:before + T].clone(), *outs],
                                           [full_lse[:, before:before + T].clone(), *lses])
            kept, kept_lse = full.clone(), full_lse.clone()
            merge.merge_into(full[before:before + T], full_lse[:, before:before + T], outs, lses, kernel=True)
            key = f"{dtype}_{parts}"
            result["out_" + key] = rel(full[before:before + T], ref)
            result["lse_" + key] = rel(full_lse[:, before:before + T], ref_lse)
            around = torch.cat([full[:before], full[before + T:]]).ne(torch.cat([kept[:before], kept[before + T:]]))
            around_lse = torch.cat([full_lse[:, :before], full_lse[:, before + T:]], 1).ne(
                torch.cat([kept_lse[:, :before], kept_lse[:, before + T:]], 1))
            result["touched_" + key] = float(around.any() or around_lse.any())

    # the cascade with the kernel, against torch_ref
    calls = []
    real_merge_into = merge.merge_into

    def counting(out, lse, outs, lses, kernel=None):
        calls.append(1 + len(outs))
        real_merge_into(out, lse, outs, lses, kernel=True)

    merge.merge_into = counting
    import ps_bridge.kernels.attention.cascade as cascade
    cascade.merge_into = counting
    toks = lambda n, s: [(s * 7 + i) % 50 for i in range(n)]
    system = toks(6, 1)
    one_level = [Sample(toks(9, 2), toks(4, 3)), Sample(toks(9, 2), toks(6, 4)), Sample(toks(5, 5), toks(3, 6))]
    tree = [Sample(system + toks(5, 7), toks(4, 8)), Sample(system + toks(5, 7), toks(3, 9)),
            Sample(system + toks(4, 10), toks(5, 11)), Sample(system + toks(4, 10), toks(2, 12))]
    for name, samples, share in (("one_level", one_level, True), ("tree", tree, "tree")):
        layout = build_layout(samples, share=share, pad_multiple=4, min_shared=1)
        q, k, v = (torch.randn(layout.num_tokens, h, 64, generator=g) for h in (4, 2, 2))
        dout = torch.randn(q.shape, generator=g) * layout.valid[:, None, None]
        got = []
        for backend in ("flash_atten_gpu", "torch_ref"):
            qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
            out = get_attention_backend(backend)(qq, kk, vv, layout, 0.125)
            got.append((out[layout.valid], *torch.autograd.grad(out, (qq, kk, vv), dout)))
        for label, a, b in zip(("out", "dq", "dk", "dv"), *got):
            result[f"cascade_{name}_{label}"] = rel(a, b)
        result[f"cascade_{name}_partials"] = max(calls)
        calls.clear()
    """
)


def test_merge_kernel_matches_the_torch_reference():
    result = run_interpreted(CHILD)
    assert result.pop("cascade_one_level_partials") == 2 and result.pop("cascade_tree_partials") == 3
    for key, value in result.items():
        if key.startswith("touched_"):
            assert value == 0, key
            continue
        tol = 8e-3 if "bfloat16" in key and key.startswith("out_") else 1e-5  # one bf16 rounding apart
        assert value <= tol, (key, value)
