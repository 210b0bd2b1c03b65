"""Bucketed layouts (`build_layout(bucket=True)`) and their CUDA-graph replays, on the CPU.

A bucketed layout pads every segment of a tree level to the level's bucket length, so layouts of
one tree shape with other lengths inside the buckets share a `structure_key`, and a graph captured
on one replays for the others once `cuda_graphs.refill` has copied in what follows the lengths (the
tokens, positions and valid flags, the attention calls' key offsets, the Gated DeltaNet conv tails).
Checked here: the padding changes no log-prob or gradient (against the unbucketed pack and Hugging
Face), and a replay (the capture replaced by a recording stand-in, as in test_cuda_graphs.py) on
layouts of other lengths equals the eager run on each, exactly, with and without gradients.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ps_bridge import cuda_graphs
from ps_bridge.cuda_graphs import ModelGraphs, buckets_for, graph_refusal, refill, static_copy
from ps_bridge.forward import _run, run_packed
from ps_bridge.kernels.attention.cascade import prefix_shared_attention_cascade
from ps_bridge.layout import build_layout
from ps_bridge.rows import PackedRows
from ps_bridge.tools.tiny_checkpoints import grpo_like_samples
from ps_bridge.tree.materialize import bucket_length
from qwen35_helpers import load_tiny, max_abs
from test_cuda_graphs import record


def test_bucket_lengths():
    assert [bucket_length(n) for n in (1, 16, 17, 24, 25, 33, 48, 49, 65, 97, 129, 200, 385)] == [
        16, 16, 24, 24, 32, 48, 48, 64, 96, 128, 192, 256, 512]
    assert bucket_length(17, 5) == 25 and bucket_length(40, 8) == 48
    for n in range(1, 3000):  # at most a third of a bucket is padding
        b = bucket_length(n)
        assert n <= b and (b <= 16 or 3 * (b - n) < b + 1)


def _samples(seed, num_prompts=3, n=3, system=0):
    # prompts of 17..24 tokens (bucket 24), responses of 5..16 (bucket 16): every seed gives the
    # same buckets, so the same structure, with other lengths. `system`: a run of that many tokens
    # every prompt begins with (a tree of depth 2: the run, each prompt's rest, the responses)
    samples = grpo_like_samples(200, num_prompts=num_prompts, n=n, prompt_len=(17, 24), response_len=(5, 16),
                                seed=seed, shuffle=False)
    head = list(range(100, 100 + system))
    return [replace(s, prompt=head + s.prompt) for s in samples]


SHARES = {"unshared": (False, 0), "groups": (True, 0), "tree": ("tree", 0), "system": ("tree", 20)}


def _bucketed(samples, share, **kw):
    return build_layout(samples, share=share, vocab_size=200, min_shared=0, bucket=True, **kw)


def _case(case, seed, **kw):
    share, system = SHARES[case]
    return _bucketed(_samples(seed, system=system, **kw), share)


@pytest.mark.parametrize("case", SHARES)
def test_a_bucketed_layout_pads_each_level_to_its_bucket(case):
    share, system = SHARES[case]
    layouts = [_case(case, seed) for seed in (0, 1, 2)]
    assert layouts[0].tree_depth == {"unshared": 0, "groups": 1, "tree": 1, "system": 2}[case]
    for layout in layouts:
        host = layout.host
        assert layout.bucketed and layout.output_positions is None
        for d in range(layout.tree_depth + 1):
            lo, hi = host["level_offsets"][d], host["level_offsets"][d + 1]
            want = bucket_length(max(host["valid_lengths"][lo:hi]))
            assert set(host["padded_lengths"][lo:hi]) == {want}
    assert layouts[0].host["valid_lengths"] != layouts[1].host["valid_lengths"]
    assert len({layout.structure_key() for layout in layouts}) == 1
    # another bucket, another structure; the unbucketed keys follow every length
    longer = _samples(0, system=system)
    longer[-1] = replace(longer[-1], response=longer[-1].response + [1] * 40)
    assert _bucketed(longer, share).structure_key() != layouts[0].structure_key()
    plain = [build_layout(_samples(seed, system=system), share=share, vocab_size=200, min_shared=0) for seed in (0, 1)]
    assert plain[0].structure_key() != plain[1].structure_key()


def read_positions(layout) -> set:
    """The packed positions the layout's rows read: from each sample's last prompt position on."""
    offsets, source = layout.row_offsets.tolist(), layout.row_source
    prompts = layout.sample_prompt_length.tolist()
    return {int(p) for i, P in enumerate(prompts) for p in source[offsets[i] + P - 1:offsets[i + 1]].tolist()}


def assert_read_positions_bucketed(layouts, differ: bool = True):
    """Shared bucketed `layouts` (of one structure) list every position their rows read, sorted, in a
    count their structure fixes: every position of a segment with response tokens (under level buckets,
    of its level's block), the last token of a segment that only ends prompts; with `differ`, the positions
    differ (other prompt lengths: other forks)."""
    for layout in layouts:
        listed = layout.output_positions.tolist()
        assert listed == sorted(set(listed)) and read_positions(layout) <= set(listed)
        # the output layer runs on those the rows read only, in order
        assert layout.logit_positions().tolist() == sorted(read_positions(layout))
        host = layout.host
        kinds, starts = host["read_kinds"], host["cu_seqlens_padded"]
        for k, kind in enumerate(kinds):
            inside = [p for p in listed if starts[k] <= p < starts[k + 1]]
            if kind == 1:
                assert inside == [starts[k] + host["valid_lengths"][k] - 1]
            elif kind == 2:
                assert inside == list(range(starts[k], starts[k + 1]))
    assert len({layout.structure_key() for layout in layouts}) == 1
    assert len({layout.output_positions.numel() for layout in layouts}) == 1
    if differ:
        assert len({tuple(layout.output_positions.tolist()) for layout in layouts}) == len(layouts)


@pytest.mark.parametrize("case", ["groups", "tree", "system"])
def test_a_bucketed_shared_layout_runs_the_output_layer_on_a_bucketed_count_of_read_positions(case):
    share, system = SHARES[case]
    layouts = [_bucketed(_samples(seed, system=system), share, prompt_values=False) for seed in (0, 1, 2)]
    assert_read_positions_bucketed(layouts)
    # short responses in the same segment buckets: fewer read positions, the same count and structure
    short = [replace(s, response=s.response[:5]) for s in _samples(0, system=system)]
    fewer = _bucketed(short, share, prompt_values=False)
    assert fewer.host["padded_lengths"] == layouts[0].host["padded_lengths"]
    assert len(read_positions(fewer)) < len(read_positions(layouts[0]))
    assert_read_positions_bucketed([fewer, layouts[0]], differ=False)
    assert layouts[0].output_positions.numel() < layouts[0].num_tokens  # the prompts' own positions are left out
    assert fewer.output_keep.numel() < fewer.output_positions.numel()  # padding is gathered, not computed
    every = _bucketed(_samples(0, system=system), share)  # prompt values: every position
    assert every.output_positions is None and every.structure_key() != layouts[0].structure_key()
    assert _bucketed(_samples(0), False, prompt_values=False).output_positions is None  # unshared: every position


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3.5"])
def tiny(request, tmp_path_factory):
    hf, loaded, _ = load_tiny(request.param, tmp_path_factory)
    return hf, loaded


def assert_bucketing_changes_nothing(hf, loaded, samples, share, config=None, **bucketing):
    """Log-probs of `samples` (`share`) and the parameter gradients of a weighted sum of them, packed with
    `bucketing` (`build_layout` options) and unbucketed, run with `config` (default the model's): equal
    within fp32 rounding, and the log-probs equal Hugging Face's."""
    config = loaded.config if config is None else config
    weights = [torch.randn(len(s.response), generator=torch.Generator().manual_seed(i)) for i, s in enumerate(samples)]
    results = {}
    for bucketed in (False, True):
        layout = build_layout(samples, share=share, vocab_size=loaded.vocab_size, min_shared=0,
                              **(bucketing if bucketed else {}))
        loaded.model.zero_grad(set_to_none=True)
        rows = PackedRows.of(layout)
        lps = rows.responses(rows.logprobs(run_packed(loaded.model, layout, config)))
        sum((lp * w).sum() for lp, w in zip(lps, weights)).backward()
        grads = {n: p.grad.clone() for n, p in loaded.model.named_parameters() if p.grad is not None}
        results[bucketed] = ([lp.detach() for lp in lps], grads)
    loaded.model.zero_grad(set_to_none=True)
    assert max_abs(results[True][0], results[False][0]) <= 1e-5
    assert results[True][1].keys() == results[False][1].keys()
    for name, g in results[True][1].items():
        torch.testing.assert_close(g, results[False][1][name], rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad():
        for s, got in zip(samples, results[True][0]):
            ids = torch.tensor([s.prompt + s.response])
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            P = len(s.prompt)
            want = logp[P - 1:-1].gather(1, ids[0, P:, None])[:, 0]
            assert (got - want).abs().max().item() <= 2e-5


@pytest.mark.parametrize("case", SHARES)
def test_bucketed_log_probs_and_gradients_equal_the_unbucketed_pack_and_hf(tiny, case):
    hf, loaded = tiny
    share, system = SHARES[case]
    assert_bucketing_changes_nothing(hf, loaded, _samples(3, system=system), share, bucket=True)


@pytest.mark.parametrize("case", ["groups", "system"])
def test_bucketed_read_positions_change_nothing(tiny, case):
    hf, loaded = tiny
    share, system = SHARES[case]
    assert_bucketing_changes_nothing(hf, loaded, _samples(3, system=system), share, bucket=True, prompt_values=False)


def _forward(model, config):
    return lambda own, weights=None, **kwargs: _run(model, own, config, weights, **kwargs)


def assert_replays_equal_eager(model, config, layouts, training: bool):
    """`layouts` (one structure, other lengths) run through one model's graphs (captured by the
    recording stand-in) as `cuda_graphs.graphed` runs them under `config`: each output, and with `training` each parameter gradient of a
    random weighting of it, equal the eager run's exactly; one capture, a replay for each layout from
    the second on."""
    graphs = ModelGraphs(capture=record)
    eager_config = replace(config, cuda_graphs=False)
    outs = []
    for i, layout in enumerate(layouts):
        with torch.set_grad_enabled(training):
            out = cuda_graphs.run_graphed(graphs, model, layout, config.backend, _forward(model, config))
            eager = run_packed(model, layout, eager_config)
        assert torch.equal(out.detach(), eager.detach())
        outs.append(eager.detach())
        if training:
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(i))
            model.zero_grad(set_to_none=True)
            (out * w).sum().backward()
            got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            (eager * w).sum().backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    assert torch.equal(got[n], p.grad), n
            model.zero_grad(set_to_none=True)
    assert (graphs.captures, graphs.replays) == (1, len(layouts) - 1)
    assert not torch.equal(outs[-2], outs[-1])  # the layouts' outputs differ: the replays were refilled


@pytest.mark.parametrize("case", SHARES)
def test_a_replay_on_other_lengths_equals_eager(tiny, case):
    _, loaded = tiny
    layouts = [_case(case, seed) for seed in (0, 1, 2, 4)]
    assert len({layout.structure_key() for layout in layouts}) == 1
    assert_replays_equal_eager(loaded.model, replace(loaded.config, cuda_graphs=True), layouts, training=False)


@pytest.mark.parametrize("case", ["unshared", "system"])
def test_a_training_replay_on_other_lengths_equals_eager(tiny, case):
    _, loaded = tiny
    layouts = [_case(case, seed) for seed in (0, 1, 2)]
    assert_replays_equal_eager(loaded.model, replace(loaded.config, cuda_graphs=True), layouts, training=True)


@pytest.mark.parametrize("training", [False, True])
def test_a_replay_refills_the_read_positions(tiny, training):
    """Shared layouts that list their read positions (other positions for other lengths, one count):
    the replay runs the output layer on each layout's own."""
    _, loaded = tiny
    layouts = [_bucketed(_samples(seed, system=20), "tree", prompt_values=False) for seed in (0, 1, 2)]
    assert_read_positions_bucketed(layouts)
    assert_replays_equal_eager(loaded.model, replace(loaded.config, cuda_graphs=True), layouts, training=training)


def test_the_cascade_reads_refilled_key_offsets():
    """The cascade's ancestor calls on a bucketed layout: their key offsets follow the valid
    lengths; refilled from another layout of the same structure, the captured layout's calls give
    that layout's attention (bf16 on the CPU kernels, which read the same device offsets)."""
    a, b = (_case("system", seed, num_prompts=2, n=3) for seed in (0, 1))
    assert a.tree_depth == 2
    assert a.structure_key() == b.structure_key() and a.host["valid_lengths"] != b.host["valid_lengths"]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(a.num_tokens, 4, 16, generator=g).bfloat16()
    k, v = (torch.randn(a.num_tokens, 2, 16, generator=g).bfloat16() for _ in range(2))
    own = static_copy(a)
    prefix_shared_attention_cascade(q, k, v, own, 0.25)  # builds and registers the offsets
    assert own.host["varying"]
    refill(own, b)
    got = prefix_shared_attention_cascade(q, k, v, own, 0.25)
    want = prefix_shared_attention_cascade(q, k, v, b, 0.25)
    valid = b.valid
    assert torch.equal(got[valid], want[valid])
    stale = prefix_shared_attention_cascade(q, k, v, a, 0.25)
    assert not torch.equal(stale[valid], want[valid])


def test_buckets_only_where_graphs_run(tiny, monkeypatch):
    _, loaded = tiny
    config = replace(loaded.config, cuda_graphs=True)
    assert not buckets_for(loaded.model, loaded.config)  # option off
    assert not buckets_for(loaded.model, config)  # a CPU model
    on_cuda = _case("groups", 0)
    monkeypatch.setattr(type(on_cuda), "device", property(lambda self: torch.device("cuda")))
    assert graph_refusal(loaded.model, on_cuda, "flash_atten_gpu") is None
    assert "'flex' on a bucketed layout" in graph_refusal(loaded.model, on_cuda, "flex")
    # a model on CUDA buckets, unless captures have stopped in the process (its passes then run eagerly,
    # and the sharing rule decides as for eager passes)
    monkeypatch.setattr(cuda_graphs, "parameter_device", lambda model: torch.device("cuda"))
    config = replace(config, backend="flash_atten_gpu")
    assert buckets_for(loaded.model, config)
    monkeypatch.setattr(ModelGraphs, "stopped", "a capture failed")
    assert not buckets_for(loaded.model, config)


@pytest.mark.parametrize("case", SHARES)
@pytest.mark.parametrize("pad_multiple, total_multiple", [(1, 1), (2, 1), (4, 24)])
def test_bucketed_tokens_are_the_bucketed_packs_tokens(case, pad_multiple, total_multiple):
    """The rule counts the bucketed pack before packing it: the count is the pack's size."""
    from ps_bridge.layout import decide_tree
    from ps_bridge.tree.materialize import bucketed_tokens
    from ps_bridge.tree.order import pack_order

    share, system = SHARES[case]
    samples = _samples(1, system=system)
    tree = decide_tree(samples, share, vocab_size=200, min_shared=0)
    layout = _bucketed(samples, share, pad_multiple=pad_multiple, total_multiple=total_multiple)
    assert bucketed_tokens(tree, pack_order(tree), pad_multiple, total_multiple) == layout.num_tokens


def test_a_bucketed_shared_pack_larger_than_the_samples_runs_unshared(monkeypatch):
    """Under CUDA graphs the rule shares every micro-batch with something to share; where the
    bucketed shared pack would hold more than 9/10 of the samples' tokens (uneven long responses
    padded to their level's bucket), the micro-batch runs eagerly as the rule decides without graphs:
    here (no model cost: the rule shares) shared and unbucketed, and unshared where sharing is off."""
    from ps_bridge import prepare
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.plan import SharingPlan
    from ps_bridge.prepare import micro_batch_layout

    config = PrefixSharingConfig(enabled=True, cuda_graphs=True)
    plan = SharingPlan.from_config(config, 1, bucket=True)

    packed = []

    def run(samples):
        packed.clear()
        return micro_batch_layout(samples, config, None, "cuda", "bfloat16", plan=plan, vocab_size=200, total_multiple=1)

    monkeypatch.setattr(prepare, "build_layout", lambda *a, **kw: packed.append(kw["bucket"]) or build_layout(*a, **kw))
    layout, decision = run(_samples(0))
    assert decision.share and decision.bucketed and layout.bucketed and packed == [True]
    assert layout.num_tokens * 10 <= layout.tokens_unshared * 9
    uneven = grpo_like_samples(200, num_prompts=3, n=3, prompt_len=(5, 8), response_len=(10, 100), seed=0, shuffle=False)
    bucketed = build_layout(uneven, share="tree", vocab_size=200, bucket=True)
    assert bucketed.num_tokens * 10 > bucketed.tokens_unshared * 9
    layout, decision = run(uneven)
    assert decision.share and not decision.bucketed and packed == [False]  # decided once, packed once
    assert f"bucketed shared pack would hold {bucketed.num_tokens} tokens" in decision.reason
    assert "without graphs" in decision.reason
    assert not layout.bucketed and layout.has_sharing and layout.output_positions is not None
    eager = build_layout(uneven, share="tree", vocab_size=200)
    assert layout.num_tokens == eager.num_tokens and torch.equal(layout.tokens, eager.tokens)
    off = micro_batch_layout(uneven, replace(config, enabled=False), None, "cuda", "bfloat16", plan=plan,
                             vocab_size=200, total_multiple=1)[0]
    assert not off.bucketed and not off.shared and off.num_tokens == off.tokens_unshared
    forced, decision = micro_batch_layout(uneven, replace(config, sharing="on"), None, "cuda", "bfloat16", plan=plan,
                                          vocab_size=200, total_multiple=1)
    assert decision.share and forced.bucketed
