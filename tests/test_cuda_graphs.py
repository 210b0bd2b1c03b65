"""The CUDA-graph path's bookkeeping against eager runs, on the CPU (`ps_bridge.cuda_graphs`).

A graph replays the forward it captured on the captured layout's device tensors, with only the token
ids copied in. Here the capture is replaced by one that records the forward and reruns it on the
captured layout (its token buffer refilled, as a replay does): a micro-batch of the same structure
with other tokens must then give the eager forward's logits exactly, for the shared and the unshared
pack, softmax attention and Gated DeltaNet alike. Capturing, replaying and dropping graphs are
counted; a failed capture stays eager. The GPU's own capture is checked in tests/test_cuda_graphs_gpu.py.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.compat import fla as compat_fla
from ps_bridge.cuda_graphs import COUNTS, GraphMemory, ModelGraphs, graph_refusal, parameter_aliases
from ps_bridge.forward import _run, run_packed
from ps_bridge.layout import Sample, build_layout
from ps_bridge.tools.tiny_checkpoints import grpo_like_samples
from qwen35_helpers import load_tiny


class Rerun:
    """Stands in for a CUDA graph: `replay()` reruns what was recorded; `pool()` is the memory pool it
    was captured into."""

    def __init__(self, run, pool):
        self.replay = run
        self.pool = lambda: pool


class Recorded:
    """Stands in for `cuda_graphs.CudaGraphCapture`: each "graph" reruns the recorded pass on the
    captured layout (whose token buffer a replay refills) into the static tensors. The backward's
    rerun recomputes the forward on the tokens of the last forward replay, as a captured backward
    reads the activations that replay saved. A capture without a pool makes one (a fresh object)."""

    @staticmethod
    def forward(run, pool=None):
        output = run()
        return Rerun(lambda: output.copy_(run()), pool or object()), output

    @staticmethod
    def training(run, named, pool, grads):
        pool = pool or object()
        aliases = parameter_aliases(named)
        params = tuple(aliases.values())
        output = run(aliases)
        reached = torch.autograd.grad(output, params, torch.ones_like(output), allow_unused=True)
        grads = tuple(None if g is None else b for b, g in zip(grads, reached))
        grad_output = torch.empty_like(output)
        output = output.detach()

        def backward():
            with torch.enable_grad():  # an autograd Function's backward runs without gradients
                new = torch.autograd.grad(run(aliases), params, grad_output, allow_unused=True)
            for static, g in zip(grads, new):
                if static is not None:
                    static.copy_(g)

        return Rerun(lambda: output.copy_(run(aliases).detach()), pool), output, Rerun(backward, pool), grad_output, grads


record = Recorded


def relabelled(samples, vocab: int, shift: int):
    """The same samples with every token id moved by `shift` (mod the vocabulary): equal tokens stay
    equal, so the prefix tree, and with it every layout tensor but the tokens, is the same."""
    def move(ids):
        return [(t + shift) % vocab for t in ids]

    return [Sample(prompt=move(s.prompt), response=move(s.response)) for s in samples]


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3.5"])
def loaded(request, tmp_path_factory):
    _, loaded, _ = load_tiny(request.param, tmp_path_factory)
    return loaded


def _samples(loaded, seed=0):
    return grpo_like_samples(min(loaded.vocab_size, 248), num_prompts=3, n=3, prompt_len=(5, 13),
                             response_len=(1, 7), seed=seed)


def _layout(loaded, samples, share):
    return build_layout(samples, share=share, vocab_size=loaded.vocab_size, min_shared=0)


def _has_gdn(loaded) -> bool:
    return any(type(m).__name__ == "PrefixSharedGatedDeltaNet" for m in loaded.model.modules())


def test_structure_key_is_the_layout_without_its_tokens(loaded):
    samples = _samples(loaded)
    vocab = min(loaded.vocab_size, 248)
    for share in (False, True, "tree"):
        layout = _layout(loaded, samples, share)
        again = _layout(loaded, relabelled(samples, vocab, 17), share)
        assert not torch.equal(layout.tokens, again.tokens)
        assert layout.structure_key() == again.structure_key()
    keys = {share: _layout(loaded, samples, share).structure_key() for share in (False, True)}
    assert keys[False] != keys[True]
    longer = [replace(s) for s in samples]
    longer[-1] = Sample(prompt=samples[-1].prompt, response=samples[-1].response + [1])
    assert _layout(loaded, longer, True).structure_key() != keys[True]
    # a moved copy answers from the CPU layout it was moved from (`to` keeps it in `host`)
    layout = _layout(loaded, samples, True)
    moved = layout.to("cpu")
    assert moved.host["cpu_layout"] is layout
    assert moved.structure_key() == keys[True]


@pytest.mark.parametrize("share", [False, True, "tree"])
def test_replayed_forward_equals_eager(loaded, share):
    model, config = loaded.model, replace(loaded.config, cuda_graphs=True)
    vocab = min(loaded.vocab_size, 248)
    samples = _samples(loaded)
    layouts = [_layout(loaded, relabelled(samples, vocab, shift), share) for shift in (0, 5, 11)]
    graphs = ModelGraphs(capture=record)

    def forward(layout, weights=None):
        return run_packed(model, layout, config)

    outputs = []
    with torch.no_grad():
        for layout in layouts:
            outputs.append(graphs.run(model, layout, ("torch_ref",), forward))
        eager = [forward(layout) for layout in layouts]
    assert (graphs.captures, graphs.replays) == (1, 2)  # seen once eagerly, captured on the second
    for got, want in zip(outputs, eager):
        assert torch.equal(got, want)
    assert not torch.equal(eager[1], eager[2])  # the tokens matter: a replay did not return a stale output


def _loss_and_grads(model, logits, weights):
    model.zero_grad(set_to_none=True)
    (logits.float() * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("share", [False, "tree"])
def test_replayed_training_pass_equals_eager(loaded, share):
    """Forward and backward replayed: the logits and every parameter's gradient of each micro-batch
    equal the eager run's, with the loss (outside the graphs) weighting the logits."""
    model, config = loaded.model, replace(loaded.config, cuda_graphs=True)
    vocab = min(loaded.vocab_size, 248)
    samples = _samples(loaded)
    layouts = [_layout(loaded, relabelled(samples, vocab, shift), share) for shift in (0, 5, 11)]
    graphs = ModelGraphs(capture=record)
    got, want = [], []
    for i, layout in enumerate(layouts):
        out = graphs.run(model, layout, (), lambda own, weights: _run(model, own, config, weights))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(i))
        got.append((out.detach(), _loss_and_grads(model, out, weights)))
        eager = run_packed(model, layout, loaded.config)
        want.append((eager.detach(), _loss_and_grads(model, eager, weights)))
    assert (graphs.captures, graphs.replays) == (1, 2)
    for (out, grads), (out_e, grads_e) in zip(got, want):
        assert torch.equal(out, out_e)
        assert grads.keys() == grads_e.keys()
        for name in grads:
            assert torch.equal(grads[name], grads_e[name]), name
    model.zero_grad(set_to_none=True)


def test_the_first_run_builds_what_the_capture_reads(loaded):
    """A structure's first, eager run is on the layout its graph will read (not the caller's), so the
    capture finds every plan the pass derives from it already made: none is built inside a capture
    (where a copy from the host fails, and a cache's value could be freed under the graph)."""
    model, config = loaded.model, replace(loaded.config, cuda_graphs=True)
    vocab = min(loaded.vocab_size, 248)
    layouts = [_layout(loaded, relabelled(_samples(loaded), vocab, shift), "tree") for shift in (0, 5, 11)]
    calls = []

    def forward(layout, weights=None):
        calls.append((layout, set(layout.host.get("derived", {}))))
        return run_packed(model, layout, config)

    graphs = ModelGraphs(capture=record)
    with torch.no_grad():
        got = [graphs.run(model, layout, ("torch_ref",), forward) for layout in layouts]
        want = [run_packed(model, layout, config) for layout in layouts]
    assert (graphs.captures, graphs.replays) == (1, 2)
    (first, before_first), (captured, before_capture) = calls[:2]
    assert first is captured and all(first is not layout for layout in layouts)
    assert not before_first and before_capture and before_capture == set(first.host["derived"])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_capture_of_gated_deltanet_turns_fla_s_identity_cache_off(loaded):
    """What fla derives from the varlen offsets inside a captured pass is computed into the graph's
    memory, not taken from fla's identity cache, which would free it while the graph reads it."""
    fla_utils = pytest.importorskip("fla.utils")
    seen = []

    class Watching:
        @staticmethod
        def forward(run, pool=None):
            seen.append(getattr(fla_utils, "FLA_DISABLE_TENSOR_CACHE", False))
            return record.forward(run, pool)

    config = replace(loaded.config, cuda_graphs=True)
    graphs = ModelGraphs(capture=Watching)
    with torch.no_grad():
        for shift in (0, 5):
            layout = _layout(loaded, relabelled(_samples(loaded), min(loaded.vocab_size, 248), shift), True)
            graphs.run(loaded.model, layout, ("torch_ref",), lambda own, weights=None: run_packed(loaded.model, own, config))
    assert seen == [_has_gdn(loaded)] and not getattr(fla_utils, "FLA_DISABLE_TENSOR_CACHE", False)


def test_a_forward_before_the_last_ones_backward_runs_eagerly(loaded):
    """Two forwards of one structure before their backwards: the second runs eagerly (a replay
    would overwrite the activations the first one's backward reads), and both gradients are right."""
    model, config = loaded.model, replace(loaded.config, cuda_graphs=True)
    vocab = min(loaded.vocab_size, 248)
    samples = _samples(loaded)
    a, b, c = (_layout(loaded, relabelled(samples, vocab, shift), True) for shift in (0, 3, 9))
    graphs = ModelGraphs(capture=record)
    for layout in (a, a):  # seen, then captured
        out = graphs.run(model, layout, (), lambda own, weights: _run(model, own, config, weights))
        out.sum().backward()
    model.zero_grad(set_to_none=True)
    # the capture's own replay, then b; c runs eagerly
    _two_passes_before_their_backward(loaded, graphs, lambda own, weights: _run(model, own, config, weights), b, c, 1)


def _two_passes_before_their_backward(loaded, graphs, run, first, second, replayed):
    """`first`'s pass, then `second`'s, then one backward of both: `replayed` of the passes replay, and the
    gradients equal eager ones."""
    model = loaded.model
    replays = graphs.replays
    outs = [graphs.run(model, layout, (), run) for layout in (first, second)]
    assert graphs.replays == replays + replayed
    (outs[0].sum() + 2 * outs[1].sum()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (run_packed(model, first, loaded.config).sum() + 2 * run_packed(model, second, loaded.config).sum()).backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-6, atol=1e-6)
    model.zero_grad(set_to_none=True)


class PoolActivations(Recorded):
    """`Recorded`, with what the graphs of one pool share on a GPU: a backward graph reads the activations
    that the last forward replayed in its pool left there, whichever graph that was (graphs captured into
    one pool reuse each other's blocks)."""

    last: dict = {}

    @staticmethod
    def training(run, named, pool, grads):
        pool = pool or object()
        forward, output, _, grad_output, grads = Recorded.training(run, named, pool, grads)
        aliases = parameter_aliases(named)
        params = tuple(aliases.values())
        replay_forward = forward.replay

        def forward_replay():
            PoolActivations.last[pool] = run
            replay_forward()

        def backward():
            with torch.enable_grad():
                new = torch.autograd.grad(PoolActivations.last[pool](aliases), params, grad_output, allow_unused=True)
            for static, g in zip(grads, new):
                if static is not None:
                    static.copy_(g)

        return Rerun(forward_replay, pool), output, Rerun(backward, pool), grad_output, grads


def _captured_for_training(loaded, layouts, capture):
    model, config = loaded.model, replace(loaded.config, cuda_graphs=True)
    graphs = ModelGraphs(capture=capture)
    run = lambda own, weights: _run(model, own, config, weights)  # noqa: E731
    for layout in layouts:
        for _ in range(2):
            graphs.run(model, layout, (), run).sum().backward()
    model.zero_grad(set_to_none=True)
    return graphs, run


def test_no_graph_of_the_pool_replays_while_a_backward_awaits(loaded):
    """Another structure's pass between a replayed forward and its backward runs eagerly: replayed, it
    would overwrite the activations the backward reads (the stand-in's backward reads whatever the
    pool's last forward left), and both gradients are right."""
    model = loaded.model
    a, _, c = _three_structures(loaded)
    graphs, run = _captured_for_training(loaded, (a, c), PoolActivations)
    replays = graphs.replays
    _two_passes_before_their_backward(loaded, graphs, run, a, c, 1)
    graphs.run(model, c, (), run).sum().backward()  # once the backward ran, the pool replays again
    assert graphs.replays == replays + 2
    model.zero_grad(set_to_none=True)


def test_a_replayed_pass_dropped_before_its_backward_frees_the_pool(loaded):
    model = loaded.model
    a, _, c = _three_structures(loaded)
    graphs, run = _captured_for_training(loaded, (a, c), record)
    replays = graphs.replays
    graphs.run(model, a, (), run).sum()  # no backward: the autograd graph is freed with its output
    assert not graphs.pools[True].awaiting_backward()
    graphs.run(model, c, (), run).sum().backward()
    assert graphs.replays == replays + 2
    model.zero_grad(set_to_none=True)


def test_a_replayed_pass_takes_one_backward(loaded):
    model = loaded.model
    a = _three_structures(loaded)[0]
    graphs, run = _captured_for_training(loaded, (a,), record)
    loss = graphs.run(model, a, (), run).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()
    model.zero_grad(set_to_none=True)


def test_other_structures_get_their_own_graph_and_old_ones_are_dropped(loaded):
    model = loaded.model
    graphs = ModelGraphs(capture=record, max_graphs=1)
    samples = _samples(loaded)
    shared, unshared = _layout(loaded, samples, True), _layout(loaded, samples, False)

    def forward(layout, weights=None):
        return run_packed(model, layout, loaded.config)

    with torch.no_grad():
        for layout in (shared, shared, unshared, unshared, shared):
            graphs.run(model, layout, ("torch_ref",), forward)
    # shared captured, then dropped for unshared (one graph kept): its third run is a first sighting
    assert graphs.captures == 2 and graphs.replays == 2
    assert [(entry.graph is not None, entry.seen) for entry in graphs.graphs.values()] == [(True, 2), (False, 1)]


def test_packs_seen_once_do_not_push_a_graph_out(loaded):
    """Structures not captured yet are counted apart from the graphs: a run of one-off packs (more than
    the graphs kept) leaves the captured graph replaying; beyond `max_seen` the oldest counts are
    forgotten, and such a structure is seen anew."""
    model = loaded.model
    graphs = ModelGraphs(capture=record, max_graphs=1, max_seen=3)
    kept = _layout(loaded, _samples(loaded), True)
    others = [_layout(loaded, _samples(loaded, seed), True) for seed in range(1, 6)]
    assert len({layout.structure_key() for layout in [kept, *others]}) == 6

    def forward(layout, weights=None):
        return run_packed(model, layout, loaded.config)

    with torch.no_grad():
        for layout in (kept, kept, *others, kept):
            graphs.run(model, layout, ("torch_ref",), forward)
        assert graphs.captures == 1 and graphs.replays == 2  # captured, replayed at its capture and at the end
        graphs.run(model, others[0], ("torch_ref",), forward)  # forgotten (beyond max_seen): a first sighting
        assert graphs.captures == 1
        graphs.run(model, others[-1], ("torch_ref",), forward)  # still counted: its second run, captured
    assert graphs.captures == 2 and graphs.replays == 3
    assert [entry.graph is not None for entry in graphs.graphs.values()].count(True) == 1


class Budget(GraphMemory):
    """The process's graph memory on a device of `total` bytes (the share left at 1), each pool holding a
    byte per token of the largest pass captured into it (its graphs share its memory)."""

    def __init__(self, total: int, stale_passes: int = 64):
        super().__init__(pool_bytes=lambda pool: max(pool.tokens.values(), default=0), total=lambda: total,
                         fraction=1.0, stale_passes=stale_passes)


def _three_structures(loaded):
    samples = _samples(loaded)
    return _layout(loaded, samples, True), _layout(loaded, samples, False), _layout(loaded, _samples(loaded, 1), True)


def _eager(loaded):
    return lambda own, weights=None: run_packed(loaded.model, own, loaded.config)


def test_a_models_passes_share_a_pool_per_kind_and_its_graphs_take_its_largest(loaded):
    """The forward-only graphs of a model are captured into one pool, its passes with gradients into
    another; the pool holds its largest pass, and every backward graph of it writes the pool's
    gradient buffers."""
    model, config = loaded.model, replace(loaded.config, cuda_graphs=True)
    a, b, c = _three_structures(loaded)
    memory = Budget(total=10**9)
    graphs = ModelGraphs(capture=record, memory=memory)
    run = lambda own, weights: _run(model, own, config, weights)  # noqa: E731
    with torch.no_grad():
        for layout in (a, a, b, b, c, c):
            graphs.run(model, layout, (), run)
    for layout in (a, a, c, c):
        graphs.run(model, layout, (), run).sum().backward()
    model.zero_grad(set_to_none=True)
    forward_only = [e.graph.pool() for k, e in graphs.graphs.items() if not k[1]]
    training = [e for k, e in graphs.graphs.items() if k[1]]
    assert len(forward_only) == 3 and len(set(forward_only)) == 1 and forward_only[0] is graphs.pools[False].handle
    assert len(training) == 2 and {e.graph.pool() for e in training} == {graphs.pools[True].handle}
    assert graphs.pools[True].handle is not graphs.pools[False].handle
    assert all(g is None or any(g is buf for buf in graphs.pools[True].grads) for e in training for g in e.grads)
    assert [g is None for g in training[0].grads] == [g is None for g in training[1].grads]
    biggest = max(x.num_tokens for x in (a, b, c))
    assert memory.used() == biggest + max(a.num_tokens, c.num_tokens) == graphs.pools[False].nbytes + graphs.pools[True].nbytes


def test_a_graph_beyond_the_memory_share_is_not_kept_while_the_others_run(loaded, caplog):
    """Room for the pool of the two smaller structures: the largest, whose capture would grow the pool
    past the share (predicted from the pool's bytes per token), is not captured and runs eagerly from
    then on; the two held replay; outputs equal eager."""
    model, forward = loaded.model, _eager(loaded)
    small, other, big = sorted(_three_structures(loaded), key=lambda x: x.num_tokens)
    assert small.num_tokens <= other.num_tokens < big.num_tokens
    memory = Budget(total=other.num_tokens)
    graphs = ModelGraphs(capture=record, memory=memory)
    left_eager = COUNTS["no_room"]
    caplog.set_level("DEBUG", logger="ps_bridge")
    with torch.no_grad():
        for layout in (small, small, other, other, big, big):
            graphs.run(model, layout, (), forward)
        assert memory.used() == other.num_tokens
        assert {k[0] for k in graphs.graphs} == {small.structure_key(), other.structure_key()}
        replays = graphs.replays
        for layout in (big, big, small, other):
            assert torch.equal(graphs.run(model, layout, (), forward), forward(layout))
    assert graphs.replays == replays + 2 and graphs.captures == 2  # big: eager, its size predicted
    assert [k[0] for k in graphs.no_room] == [big.structure_key()] and COUNTS["no_room"] == left_eager + 1
    said = [r.getMessage() for r in caplog.records if "runs eagerly from now on" in r.getMessage()]
    assert len(said) == 1 and f"a {big.num_tokens}-token pass" in said[0] and "PS_BRIDGE_CUDA_GRAPH_MEMORY" in said[0]


def test_stale_pools_make_room(loaded):
    """A pool none of whose graphs ran in the last `stale_passes` graphed passes is dropped whole for a
    new capture (verl's phases: the log-prob passes' pool for the update's); its structures, back
    again, are seen and captured anew."""
    model, config = loaded.model, replace(loaded.config, cuda_graphs=True)
    a, b, _ = _three_structures(loaded)
    memory = Budget(total=a.num_tokens + b.num_tokens - 1, stale_passes=1)
    graphs = ModelGraphs(capture=record, memory=memory)
    run = lambda own, weights: _run(model, own, config, weights)  # noqa: E731
    with torch.no_grad():
        for _ in range(2):
            graphs.run(model, a, (), run)
    for _ in range(2):  # a's pool last ran 2 passes before b's capture: dropped for it
        graphs.run(model, b, (), run).sum().backward()
    assert [k for k, e in graphs.graphs.items() if e.graph is not None] == [(b.structure_key(), True)]
    assert memory.used() == b.num_tokens and graphs.pools[False].handle is None and not graphs.no_room
    with torch.no_grad():  # a seen anew; at its capture b's pool is stale
        outs = [graphs.run(model, a, (), run) for _ in range(3)]
        assert all(torch.equal(o, run_packed(model, a, loaded.config)) for o in outs)
    assert [k for k, e in graphs.graphs.items() if e.graph is not None] == [(a.structure_key(), False)]
    assert graphs.captures == 3 and memory.used() == a.num_tokens
    model.zero_grad(set_to_none=True)


def test_a_graph_larger_than_the_share_is_not_kept(loaded):
    model = loaded.model
    a = _three_structures(loaded)[0]
    graphs = ModelGraphs(capture=record, memory=Budget(total=a.num_tokens - 1))
    with torch.no_grad():
        outs = [graphs.run(model, a, (), _eager(loaded)) for _ in range(4)]
    assert (graphs.captures, graphs.replays, len(graphs.graphs)) == (1, 0, 0)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_the_memory_share_spans_the_models_of_the_process(loaded):
    """Two models (verl's actor and reference) share the device: the second's graph does not fit beside
    the first's, which runs; once the first's is stale, it makes room; a dead model's graphs stop counting."""
    import gc

    a, b, _ = _three_structures(loaded)
    memory = Budget(total=a.num_tokens + b.num_tokens - 1, stale_passes=2)
    first, second = ModelGraphs(capture=record, memory=memory), ModelGraphs(capture=record, memory=memory)
    model, forward = loaded.model, _eager(loaded)
    with torch.no_grad():
        for graphs, layout in ((first, a), (first, a), (second, b), (first, a), (second, b)):
            graphs.run(model, layout, (), forward)
        assert (first.captures, len(first.graphs), len(second.graphs)) == (1, 1, 0) and second.no_room
        other = ModelGraphs(capture=record, memory=memory)
        for layout in (b, b, b, b):  # a not run for 3 passes at b's capture: dropped for it
            other.run(model, layout, (), forward)
    assert (len(first.graphs), len(other.graphs), memory.used()) == (0, 1, b.num_tokens)
    del other
    gc.collect()
    assert memory.used() == 0


def test_a_graph_whose_backward_is_pending_is_not_dropped(loaded):
    """A replayed forward whose backward has not run holds its graph, stale or not: a capture beyond the
    share is not kept, and the pending backward's gradients are right."""
    model, config = loaded.model, replace(loaded.config, cuda_graphs=True)
    a, b, _ = _three_structures(loaded)
    memory = Budget(total=a.num_tokens + b.num_tokens - 1, stale_passes=0)
    graphs = ModelGraphs(capture=record, memory=memory)
    run = lambda own, weights: _run(model, own, config, weights)  # noqa: E731
    graphs.run(model, a, (), run).sum().backward()
    graphs.run(model, a, (), run).sum().backward()  # captured (and replayed)
    pending = graphs.run(model, a, (), run)  # replayed, its backward not yet run
    with torch.no_grad():
        graphs.run(model, b, (), run)
        graphs.run(model, b, (), run)
    assert [k[0] for k in graphs.graphs] == [a.structure_key()] and [k[0] for k in graphs.no_room] == [b.structure_key()]
    model.zero_grad(set_to_none=True)
    pending.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    run_packed(model, a, loaded.config).sum().backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-6, atol=1e-6)
    model.zero_grad(set_to_none=True)


def test_the_memory_share_reads_its_environment_variable(monkeypatch):
    monkeypatch.setenv("PS_BRIDGE_CUDA_GRAPH_MEMORY", "0.4")
    assert PrefixSharingConfig.from_env().cuda_graph_memory == 0.4
    monkeypatch.delenv("PS_BRIDGE_CUDA_GRAPH_MEMORY")
    assert PrefixSharingConfig.from_env().cuda_graph_memory == PrefixSharingConfig.cuda_graph_memory
    for bad in ("0", "1.5", "lots"):
        monkeypatch.setenv("PS_BRIDGE_CUDA_GRAPH_MEMORY", bad)
        with pytest.raises(ValueError, match="PS_BRIDGE_CUDA_GRAPH_MEMORY"):
            PrefixSharingConfig.from_env()


def test_moved_parameters_drop_the_graphs(loaded):
    model = loaded.model
    graphs = ModelGraphs(capture=record)
    layout = _layout(loaded, _samples(loaded), True)

    def forward(own, weights=None):
        return run_packed(model, own, loaded.config)

    with torch.no_grad():
        graphs.run(model, layout, (), forward)
        graphs.run(model, layout, (), forward)
        assert graphs.captures == 1
        param = next(model.parameters())
        saved = param.data
        param.data = saved.clone()  # new storage, as an offload and reload gives
        try:
            graphs.run(model, layout, (), forward)
            assert graphs.replays == 1 and len(graphs.graphs) == 1  # dropped, then seen once more
            graphs.run(model, layout, (), forward)
            assert graphs.captures == 2
        finally:
            param.data = saved


def test_a_failed_capture_stays_eager(loaded, caplog, monkeypatch):
    monkeypatch.setattr(ModelGraphs, "stopped", None)
    model = loaded.model
    calls = []

    class Failing:
        @staticmethod
        def forward(run, pool=None):
            calls.append(1)
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    graphs = ModelGraphs(capture=Failing)
    layout = _layout(loaded, _samples(loaded), True)
    with torch.no_grad():
        eager = run_packed(model, layout, loaded.config)
        got = [graphs.run(model, layout, (), lambda own, weights: _run(model, own, loaded.config, weights)) for _ in range(3)]
    assert len(calls) == 1 and graphs.captures == 0
    assert all(torch.equal(g, eager) for g in got)
    assert "a capture failed (operation not permitted when stream is capturing)" in caplog.text
    # no other capture is tried in this process
    assert ModelGraphs.stopped
    again = ModelGraphs(capture=Failing)
    with torch.no_grad():
        for _ in range(3):
            again.run(model, layout, (), lambda own, weights: _run(model, own, loaded.config, weights))
    assert len(calls) == 1
    monkeypatch.setattr(ModelGraphs, "stopped", None)


def test_where_graphs_do_not_run(loaded, monkeypatch):
    layout = _layout(loaded, _samples(loaded), True)
    assert "CUDA device" in graph_refusal(loaded.model, layout)
    # on a CUDA device: settings of the model under which megatron sets the RNG state inside a pass
    on_cuda = SimpleNamespace(device=torch.device("cuda"), images=None, bucketed=False, level_buckets=False)  # what graph_refusal reads
    assert graph_refusal(loaded.model, on_cuda) is None
    config = loaded.model.config
    monkeypatch.setattr(config, "recompute_granularity", "full")
    assert "activation recomputation" in graph_refusal(loaded.model, on_cuda)
    monkeypatch.setattr(config, "recompute_granularity", None)
    monkeypatch.setattr(config, "hidden_dropout", 0.1)
    assert "dropout (hidden_dropout=0.1" in graph_refusal(loaded.model, on_cuda)
    with torch.no_grad():  # a forward-only pass draws no dropout
        assert graph_refusal(loaded.model, on_cuda) is None
    monkeypatch.setattr(config, "hidden_dropout", 0.0)
    # an fla-core that ignores the caller's chunk index derives it into its own cache, which may free it
    # under a graph: Gated DeltaNet layers are refused there (attention-only models do not run fla)
    with monkeypatch.context() as old_fla:
        old_fla.setattr(compat_fla, "takes_chunk_indices", lambda: False)
        refusal = graph_refusal(loaded.model, on_cuda)
    assert ("ignores the caller's chunk index" in refusal) if _has_gdn(loaded) else refusal is None
    monkeypatch.setattr(loaded.model, "vision_model", torch.nn.Identity(), raising=False)
    assert "vision-language model" in graph_refusal(loaded.model, on_cuda)
    # with the option on, a CPU run is the eager run (and a pass with gradients never graphs)
    config = replace(loaded.config, cuda_graphs=True)
    with torch.no_grad():
        assert torch.equal(run_packed(loaded.model, layout, config), run_packed(loaded.model, layout, loaded.config))


def test_the_option_reads_its_environment_variable(monkeypatch):
    monkeypatch.setenv("PS_BRIDGE_CUDA_GRAPHS", "1")
    assert PrefixSharingConfig.from_env().cuda_graphs
    monkeypatch.setenv("PS_BRIDGE_CUDA_GRAPHS", "0")
    assert not PrefixSharingConfig.from_env().cuda_graphs


def test_a_data_parallel_wrapped_model(loaded):
    """verl hands the model inside megatron's DDP, whose `buffers` attribute (its gradient buffers)
    hides nn.Module's method: graphs fingerprint the parameters through nn.Module's own methods, and
    the pass with gradients runs the wrapped module on parameter aliases, the gradients reaching the
    parameters as after an eager backward."""
    from megatron.core.distributed import DistributedDataParallel

    class WrappedLikeDDP(DistributedDataParallel):
        def __init__(self, module):  # no process group or gradient buffers: only what graphs read
            torch.nn.Module.__init__(self)
            self.module = module
            self.buffers = []

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    model = WrappedLikeDDP(loaded.model)
    config = replace(loaded.config, cuda_graphs=True)
    vocab = min(loaded.vocab_size, 248)
    samples = _samples(loaded)
    graphs = ModelGraphs(capture=record)
    for i, shift in enumerate((0, 4, 8)):
        layout = _layout(loaded, relabelled(samples, vocab, shift), True)
        out = graphs.run(model, layout, (), lambda own, weights: _run(model, own, config, weights))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(i))
        got = _loss_and_grads(loaded.model, out, weights)
        want = _loss_and_grads(loaded.model, _run(model, layout, loaded.config), weights)
        assert all(torch.equal(got[n], want[n]) for n in want) and got.keys() == want.keys()
    assert (graphs.captures, graphs.replays) == (1, 2)
    loaded.model.zero_grad(set_to_none=True)


def test_graphs_die_with_their_model():
    """A model's graphs (and the memory they hold) go when the model goes, even where hooks on its
    parameters reach the model, as megatron's DDP hooks do."""
    import gc
    import weakref

    from ps_bridge.cuda_graphs import model_graphs

    model = torch.nn.Linear(4, 3)
    for param in model.parameters():
        param.register_hook(lambda g, m=model: g)  # a hook that reaches the model
    del param
    graphs = model_graphs(model)
    graphs.capture = record
    layout = build_layout([Sample([1, 2, 3], [4, 5]), Sample([1, 2, 3], [6])], share=True)

    gone = weakref.ref(model)

    def forward(own, weights=None):  # the recording stand-in keeps this function: it holds no model
        x = own.tokens[:4].float().view(1, 4)
        return gone()(x) if weights is None else torch.func.functional_call(gone(), weights, (x,))

    for _ in range(3):
        graphs.run(model, layout, (), forward).sum().backward()
    assert graphs.captures == 1 and graphs.replays == 2
    del model, graphs
    gc.collect()
    assert gone() is None


def _graphed_against_eager(model, loaded, config, samples, shifts=(0, 4, 8)):
    """Through `run_packed` with graphs (the CPU standing in for CUDA, `record` for the capture) and
    without: each pass's logits, and with gradients every parameter's gradient, must be equal."""
    vocab = min(loaded.vocab_size, 248)
    for i, shift in enumerate(shifts):
        layout = _layout(loaded, relabelled(samples, vocab, shift), "tree")
        with torch.no_grad():
            got, want = run_packed(model, layout, config), run_packed(model, layout, loaded.config)
        assert got.dtype == want.dtype and torch.equal(got, want)
        out = run_packed(model, layout, config)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(i))
        grads = _loss_and_grads(model, out, weights)
        want = _loss_and_grads(model, run_packed(model, layout, loaded.config), weights)
        assert grads.keys() == want.keys() and all(torch.equal(grads[n], want[n]) for n in want)
        yield out


@pytest.mark.parametrize("name,tied", [("qwen2.5", False), ("qwen2.5", True), ("qwen3.5", False)])
def test_graphs_hold_the_hidden_states_and_the_output_layer_runs_eagerly(name, tied, tmp_path, monkeypatch):
    """The graphs capture the model up to its output layer: what they hold is the final hidden states
    at the read positions, and the output layer runs eagerly on them; the logits and every gradient,
    the output layer's (with tied embeddings: the embedding's, from both uses) included, equal the
    eager pass's."""
    from ps_bridge import cuda_graphs
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    TINY_BUILDERS[name](str(tmp_path), **({"tie_word_embeddings": True} if tied else {}))
    loaded = load_model(str(tmp_path))
    assert loaded.model.share_embeddings_and_output_weights == tied
    config = replace(loaded.config, cuda_graphs=True)
    monkeypatch.setattr(cuda_graphs, "graph_refusal", lambda *args: None)  # the CPU stands in for CUDA
    graphs = cuda_graphs.model_graphs(loaded.model)
    graphs.capture = record
    outs = list(_graphed_against_eager(loaded.model, loaded, config, _samples(loaded)))
    assert (graphs.captures, graphs.replays) == (2, 4)  # a forward-only graph and one with gradients
    hidden = loaded.model.config.hidden_size
    assert [(entry.backward is not None, entry.output.shape) for entry in graphs.graphs.values()] == [
        (False, (outs[-1].shape[1], 1, hidden)), (True, (outs[-1].shape[1], 1, hidden))]  # a row per read position
    assert next(reversed(graphs.graphs.values())).grad_output.shape[-1] == hidden
    assert outs[-1].shape[-1] == loaded.model.vocab_size != hidden


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3.5"])
def test_half_precision_graphs_keep_half_precision_hidden_states(name, tmp_path_factory, monkeypatch):
    """A model in megatron's Float16Module (bf16): the graphs capture the model up to its output layer
    without the module's cast to float32 (their memory holds bf16 hidden states), and the cast follows
    the eager output layer, as in the module, so the logits (float32) and every gradient equal the
    eager pass's exactly."""
    from megatron.core.transformer.module import Float16Module

    from ps_bridge import cuda_graphs

    _, loaded, _ = load_tiny(name, tmp_path_factory)  # a model of its own: the wrapper casts it to bf16
    loaded.model.config.bf16 = True
    model = Float16Module(loaded.model.config, loaded.model)
    config = replace(loaded.config, cuda_graphs=True)
    monkeypatch.setattr(cuda_graphs, "graph_refusal", lambda *args: None)  # the CPU stands in for CUDA
    graphs = cuda_graphs.model_graphs(model)
    graphs.capture = record
    outs = list(_graphed_against_eager(model, loaded, config, _samples(loaded)))
    assert {out.dtype for out in outs} == {torch.float32}
    assert (graphs.captures, graphs.replays) == (2, 4)  # a forward-only graph and one with gradients
    assert {(entry.output.dtype, entry.output.shape[-1]) for entry in graphs.graphs.values()} == {
        (torch.bfloat16, loaded.model.config.hidden_size)}


def test_only_the_first_capture_of_each_pass_kind_warms_up(monkeypatch):
    """`_warm_up` runs the pass on a side stream before the process's first capture of its kind, then
    never again: a structure's first, eager run has already done what the capture must not."""
    from contextlib import nullcontext

    from ps_bridge import cuda_graphs

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(cuda_graphs, "_WARMED_UP", set())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    runs = []
    for training in (False, False, True, False, True):
        cuda_graphs._warm_up(lambda: runs.append(training), training=training)
    assert runs == [False, True]
