"""The chunked vocab-parallel extractors (`ps_bridge.rows`): log-probs and entropy without a float32
copy of the logits, equal to megatron's `vocab_parallel_cross_entropy` and verl's
`vocab_parallel_entropy` (values and gradients; TP=1 here, TP=2 through the verl engine tests)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ps_bridge.layout import Sample, build_layout
from ps_bridge.rows import PackedRows, chunked_vocab_parallel_entropy


@pytest.fixture(scope="module", autouse=True)
def tp_group():
    from ps_bridge.parallel.groups import init_parallel

    init_parallel(tp=1)


def _layout(vocab):
    g = torch.Generator().manual_seed(3)

    def toks(n):
        return torch.randint(vocab, (n,), generator=g).tolist()

    p1, p2 = toks(6), toks(3)
    samples = [Sample(p1, toks(4), "a"), Sample(p2, toks(5), "b"), Sample(p1, toks(2), "a"), Sample(p1, toks(3), "a")]
    return build_layout(samples, share=True, pad_multiple=1)


def test_vocab_parallel_logprobs_equal_megatron_cross_entropy_on_the_unshared_rows():
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    V = 37
    layout = _layout(V)
    rows = PackedRows(layout)
    base = torch.randn(layout.num_tokens, V, generator=torch.Generator().manual_seed(4))
    weights = torch.randn(rows.source.numel(), generator=torch.Generator().manual_seed(5))

    ours_logits = base.clone().requires_grad_(True)
    ours = rows.logprobs(ours_logits, vocab_parallel=True, chunk_rows=3)
    (ours * weights).sum().backward()

    ref_logits = base.clone().requires_grad_(True)
    expanded = ref_logits.index_select(0, rows.source)  # the unshared rows, one per row position
    ref = -vocab_parallel_cross_entropy(expanded.clone(), rows.safe_labels)
    ref = torch.where(rows.has_label, ref, torch.zeros_like(ref))
    (ref * weights).sum().backward()

    torch.testing.assert_close(ours, ref.detach(), rtol=0, atol=2e-6)
    torch.testing.assert_close(ours_logits.grad, ref_logits.grad, rtol=0, atol=2e-6)
    assert ours_logits.grad.abs().max() > 0


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed")
def test_chunked_entropy_equals_verls_vocab_parallel_entropy():
    import ps_bridge.tools.verl_check.side_by_side as vt

    vt.prepare_side_by_side()
    from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy

    base = torch.randn(23, 41, generator=torch.Generator().manual_seed(6)) * 3
    w = torch.randn(23, generator=torch.Generator().manual_seed(7))
    a = base.clone().requires_grad_(True)
    ours = chunked_vocab_parallel_entropy(a, chunk_rows=5)
    (ours * w).sum().backward()
    b = base.clone().requires_grad_(True)
    ref = vocab_parallel_entropy(b)
    (ref * w).sum().backward()
    torch.testing.assert_close(ours, ref.detach().float(), rtol=0, atol=2e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_vocab_parallel_entropy(base, chunk_rows=0)
