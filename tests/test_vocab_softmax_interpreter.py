"""The fused vocabulary-softmax kernels (`ps_bridge.kernels.vocab_softmax`), run on the CPU by Triton's
interpreter (`TRITON_INTERPRET=1`, in a child process), against the torch reference in `ps_bridge.rows`:

1. the raw kernels: per row the maximum and the sum of exp over columns `[0, keep)` (a vocabulary of
   more than one block of columns, so the online rescaling runs; keep = V, a padded vocabulary's keep
   < V, and keep = 0, a TP shard holding only padding), and `-softmax * weight` with 0 from `keep` on;
2. the rows' log-probs through them (`PackedRows.logprobs`, vocab-parallel and full-vocabulary, a
   layout with fork rows and a padded vocabulary): values and the logits' gradient equal to the
   chunked torch path. On the GPU the same kernels serve the verl engine (`ps-bridge verl-check`
   compares its log-probs and gradients with verl's stock engine).
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
    from ps_bridge.kernels import vocab_softmax
    from ps_bridge import rows as rows_mod
    from ps_bridge.layout import Sample, build_layout
    from ps_bridge.parallel.groups import init_parallel

    gen = torch.Generator().manual_seed(0)
    T, V = 5, 2 * vocab_softmax.BLOCK + 37
    base = torch.randn(T, V, generator=gen) * 4
    base[2, 5000] = 40.0  # a row whose maximum sits in a later block
    lse_in = torch.randn(T, generator=gen) + 10
    weight = torch.randn(T, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        logits = base.to(dtype)
        for keep in (V, V - 20, 0):
            m, s = vocab_softmax.row_max_sumexp(logits, keep)
            x = logits[:, :keep].float()
            if keep:
                result[f"max_{dtype}_{keep}"] = rel(m, x.max(-1).values)
                result[f"lse_{dtype}_{keep}"] = rel(m + s.log(), torch.logsumexp(x, -1))
            else:
                result[f"empty_{dtype}"] = float(not (torch.isinf(m).all() and (m < 0).all() and (s == 0).all()))
            grad = vocab_softmax.minus_weighted_softmax(logits, lse_in, weight, keep)
            ref = -(logits.float() - lse_in[:, None]).exp() * weight[:, None]
            ref[:, keep:] = 0
            result[f"grad_{dtype}_{keep}"] = rel(grad, ref.to(dtype))
            result[f"grad_dtype_{dtype}_{keep}"] = float(grad.dtype != dtype)

    # the rows' log-probs through the kernels against the chunked torch path
    init_parallel(tp=1)
    vocab = 300
    g = torch.Generator().manual_seed(3)
    toks = lambda n: torch.randint(vocab - 11, (n,), generator=g).tolist()
    p1, p2 = toks(6), toks(3)
    samples = [Sample(p1, toks(4)), Sample(p2, toks(5)), Sample(p1, toks(2)), Sample(p1, toks(3))]
    layout = build_layout(samples, share=True, vocab_size=vocab - 11)  # a padded vocabulary
    packed = torch.randn(layout.num_tokens, vocab, generator=g)
    for vocab_parallel in (True, False):
        runs = []
        for fused in (True, False):
            vocab_softmax.usable = (lambda t: True) if fused else (lambda t: False)
            pr = rows_mod.PackedRows(layout)
            logits = packed.clone().requires_grad_(True)
            out = pr.logprobs(logits, vocab_parallel=vocab_parallel, chunk_rows=4)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
            (out * w).sum().backward()
            runs.append((out.detach(), logits.grad))
        (o_f, g_f), (o_t, g_t) = runs
        result[f"rows_vp{vocab_parallel}"] = rel(o_f, o_t)
        result[f"rows_grad_vp{vocab_parallel}"] = rel(g_f, g_t)
    """
)


def test_vocab_softmax_kernels_match_the_torch_reference():
    result = run_interpreted(CHILD)
    for key, value in result.items():
        tol = 1e-2 if "bfloat16" in key and key.startswith("grad_") and "dtype" not in key else 1e-5
        assert value <= tol, (key, value)
