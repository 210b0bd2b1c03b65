"""CUDA graphs of the forward on the GPU (marker `gpu`): captured, replayed, and equal to eager.

bf16, flash kernels (the cascade on shared packs) and fla's Gated DeltaNet kernels: a pack of the
same structure with other tokens, replayed from the graph (the model up to its output layer; the
output layer eager), gives the eager forward's logits bit for bit, for the unshared pack, one level of
sharing and a prefix tree. A capture that fails would leave
the run eager; the test requires the capture to have happened.

Run on an H200:  python -m pytest -q -s -m gpu tests/test_cuda_graphs_gpu.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ps_bridge.cuda_graphs import model_graphs
from ps_bridge.forward import run_packed
from ps_bridge.layout import Sample, build_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def relabelled(samples, vocab: int, shift: int):
    def move(ids):
        return [(t + shift) % vocab for t in ids]

    return [Sample(prompt=move(s.prompt), response=move(s.response)) for s in samples]


def _loaded(name, tmp_path):
    from gdn_cases import tiny_qwen35_gpu_gdn_heads
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2, build_tiny_qwen35

    if name == "qwen2.5":
        build_tiny_qwen2(str(tmp_path), vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024)
    else:
        build_tiny_qwen35(str(tmp_path), **tiny_qwen35_gpu_gdn_heads())
    config = PrefixSharingConfig(backend="flash_atten_gpu", gdn_backend="fla" if name == "qwen3.5" else "auto",
                                 cuda_graphs=True)
    return load_model(str(tmp_path), config, dtype=torch.bfloat16)


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3.5"])
def test_replayed_graph_equals_eager(tmp_path, name):
    from test_bf16_vs_fp32_gpu import gpu_tree_samples
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

    loaded = _loaded(name, tmp_path)
    vocab = loaded.vocab_size
    eager_config = replace(loaded.config, cuda_graphs=False)
    graphs = model_graphs(loaded.model)
    cases = [
        ("unshared", grpo_like_samples(vocab, num_prompts=3, n=4, prompt_len=(20, 90), response_len=(1, 40), seed=1), False),
        ("groups", grpo_like_samples(vocab, num_prompts=3, n=4, prompt_len=(20, 90), response_len=(1, 40), seed=2), True),
        ("tree", gpu_tree_samples(vocab), "tree"),
    ]
    for label, samples, share in cases:
        captures, replays = graphs.captures, graphs.replays
        layouts = [build_layout(relabelled(samples, vocab, shift), share=share, pad_multiple=8, vocab_size=vocab)
                   .to(loaded.device) for shift in (0, 7, 13)]
        with torch.no_grad():
            graphed = [run_packed(loaded.model, layout, loaded.config) for layout in layouts]
            eager = [run_packed(loaded.model, layout, eager_config) for layout in layouts]
        assert graphs.captures == captures + 1, f"{name} {label}: the forward was not captured (see the log)"
        assert graphs.replays == replays + 2
        for i, (got, want) in enumerate(zip(graphed, eager)):
            assert torch.equal(got, want), f"{name} {label} micro-batch {i}: max diff {(got - want).abs().max()}"
        assert not torch.equal(eager[1], eager[2])
        print(f"{name} {label}: {layouts[0].num_tokens} packed tokens, depth {layouts[0].tree_depth}: replay == eager")


def _grads(model, logits, weights):
    model.zero_grad(set_to_none=True)
    (logits.float() * weights).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _relative(a: dict, b: dict) -> float:
    num = sum(float((a[n] - b[n]).norm() ** 2) for n in a) ** 0.5
    return num / max(sum(float(b[n].norm() ** 2) for n in b) ** 0.5, 1e-30)


def _gradient_within_eager_spread(model, layout, eager_config, out, eager, seed, label):
    """The gradients of a loss over `out` (the graphed pass's logits, weighted at random) within four times
    the eager backward's own run-to-run spread (flash's backward accumulates with atomics) of `eager`'s."""
    w = torch.randn(out.shape[:-1], generator=torch.Generator().manual_seed(seed)).to(out.device)[..., None]
    got, want = _grads(model, out, w), _grads(model, eager, w)
    again = _grads(model, run_packed(model, layout, eager_config), w)
    spread, err = _relative(again, want), _relative(got, want)
    print(f"{label}: gradient {err:.2e} (eager spread {spread:.2e})")
    assert err <= max(4 * spread, 1e-3)


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3.5"])
def test_replayed_training_pass_equals_eager(tmp_path, name):
    """Forward and backward graphs: the logits bit for bit, every gradient within the eager backward's
    own run-to-run spread (flash's backward accumulates with atomics), for a shared tree pack."""
    from test_bf16_vs_fp32_gpu import gpu_tree_samples

    loaded = _loaded(name, tmp_path)
    vocab = loaded.vocab_size
    eager_config = replace(loaded.config, cuda_graphs=False)
    graphs = model_graphs(loaded.model)
    samples = gpu_tree_samples(vocab)
    layouts = [build_layout(relabelled(samples, vocab, shift), share="tree", pad_multiple=8, vocab_size=vocab)
               .to(loaded.device) for shift in (0, 7, 13)]
    captures, replays = graphs.captures, graphs.replays
    for i, layout in enumerate(layouts):
        weights = torch.randn(layout.num_tokens, generator=torch.Generator().manual_seed(i)).to(loaded.device)
        out = run_packed(loaded.model, layout, loaded.config)
        w = weights[: out.reshape(-1, out.shape[-1]).shape[0]].view(*out.shape[:-1], 1)
        got = _grads(loaded.model, out, w)
        eager = run_packed(loaded.model, layout, eager_config)
        want = _grads(loaded.model, eager, w)
        again = _grads(loaded.model, run_packed(loaded.model, layout, eager_config), w)
        assert torch.equal(out.detach(), eager.detach()), f"{name} micro-batch {i}: logits differ"
        spread, err = _relative(again, want), _relative(got, want)
        print(f"{name} training micro-batch {i}: gradient {err:.2e} from eager (eager's own spread {spread:.2e})")
        assert err <= max(4 * spread, 1e-3)
    assert graphs.captures == captures + 1, f"{name}: the training pass was not captured (see the log)"
    assert graphs.replays == replays + 2


@pytest.mark.parametrize("buckets", ["segment", "level"])
@pytest.mark.parametrize("name", ["qwen2.5", "qwen3.5"])
def test_bucketed_replays_on_other_lengths(tmp_path, name, buckets):
    """Bucketed layouts of one structure with other lengths (verl's case): the forward replayed from
    one graph (its key offsets and conv tails refilled; under level buckets every segment offset and
    fla's offsets and chunk indices too) gives each layout's eager logits at every valid position bit
    for bit; with gradients, the logits bit for bit and the gradients within the eager backward's
    spread. The bucketed eager run equals the unbucketed one within bf16 rounding."""
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

    loaded = _loaded(name, tmp_path)
    level = buckets == "level"
    config = replace(loaded.config, cuda_graph_buckets=buckets)
    vocab = loaded.vocab_size
    eager_config = replace(loaded.config, cuda_graphs=False)
    graphs = model_graphs(loaded.model)
    def samples(seed, system):
        # every seed: prompt bucket 96, response bucket 48; `system`: a common run before every prompt
        # (a tree of depth 2), so the tree case is a structure of its own
        head = list(range(1, 1 + system))
        return [replace(s, prompt=head + s.prompt) for s in grpo_like_samples(
            vocab, num_prompts=3, n=4, prompt_len=(65, 96), response_len=(33, 48), seed=seed, shuffle=False)]

    def same_structure(share, system):
        """(seeds, layouts): four layouts of one structure (under level buckets: the same level blocks)."""
        found = {}
        for seed in range(1, 60):
            layout = build_layout(samples(seed, system), share=share, vocab_size=vocab, min_shared=0, bucket=True,
                                  level_buckets=level)
            found.setdefault(layout.structure_key(), []).append((seed, layout))
            group = found[layout.structure_key()]
            if len(group) == 4:
                return [seed for seed, _ in group], [layout.to(loaded.device) for _, layout in group]
        raise AssertionError(f"{name} {share}: no four layouts of one structure")

    for share, system in ((False, 0), (True, 0), ("tree", 40)):
        seeds, layouts = same_structure(share, system)
        assert len({tuple(layout.host["valid_lengths"]) for layout in layouts}) == 4
        for training in (False, True):
            captures, replays = graphs.captures, graphs.replays
            for i, layout in enumerate(layouts):
                valid = layout.valid
                with torch.set_grad_enabled(training):
                    out = run_packed(loaded.model, layout, config)
                    eager = run_packed(loaded.model, layout, eager_config)
                assert torch.equal(out[0][valid], eager[0][valid]), f"{name} {share} {training} micro-batch {i}"
                if training:
                    _gradient_within_eager_spread(loaded.model, layout, eager_config, out, eager, i,
                                                  f"{name} share={share} training micro-batch {i}")
            assert graphs.captures == captures + 1, f"{name} {share}: not captured (see the log)"
            assert graphs.replays == replays + 3
        with torch.no_grad():
            plain = build_layout(samples(seeds[-1], system), share=share, vocab_size=vocab, min_shared=0).to(loaded.device)
            a = run_packed(loaded.model, layouts[-1], eager_config)[0].float()
            b = run_packed(loaded.model, plain, eager_config)[0].float()
            rows_a = a.index_select(0, layouts[-1].row_source)
            rows_b = b.index_select(0, plain.row_source)
            diff = (rows_a - rows_b).abs().max().item()
            print(f"{name} share={share}: bucketed vs unbucketed logits max diff {diff:.3e}")
            assert diff <= 0.1 * rows_b.abs().max().item()
        print(f"{name} share={share} {buckets} buckets: {layouts[0].num_tokens} packed tokens, depth "
              f"{layouts[0].tree_depth}: bucketed replays == eager")


def mine(memory, graphs) -> int:
    """The bytes `memory` counts for the graphs of one model (its pools')."""
    return sum(pool.nbytes for g, _, pool in memory.pools() if g is graphs)


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3.5"])
def test_graphs_of_one_pool_replay_in_any_order(tmp_path, name):
    """Three structures' passes with gradients captured into one memory pool (each reusing the blocks
    the ones before it freed), then replayed in another order, each forward followed by its backward:
    logits bit for bit, gradients within the eager backward's spread; likewise the forward-only graphs.
    The pool holds less than the passes would apart (printed)."""
    from test_bf16_vs_fp32_gpu import gpu_tree_samples
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

    loaded = _loaded(name, tmp_path)
    vocab = loaded.vocab_size
    eager_config = replace(loaded.config, cuda_graphs=False)
    graphs = model_graphs(loaded.model)
    cases = {
        "unshared": (grpo_like_samples(vocab, num_prompts=3, n=4, prompt_len=(20, 90), response_len=(1, 40), seed=4), False),
        "groups": (grpo_like_samples(vocab, num_prompts=3, n=4, prompt_len=(20, 90), response_len=(1, 40), seed=5), True),
        "tree": (gpu_tree_samples(vocab), "tree"),
    }
    layouts = {label: [build_layout(relabelled(samples, vocab, shift), share=share, pad_multiple=8, vocab_size=vocab)
                       .to(loaded.device) for shift in (0, 7)] for label, (samples, share) in cases.items()}
    order = ["unshared", "groups", "tree"]
    for training in (False, True):
        captures = graphs.captures
        for label in order:  # seen, then captured
            for _ in range(2):
                with torch.set_grad_enabled(training):
                    out = run_packed(loaded.model, layouts[label][0], loaded.config)
                if training:
                    out.float().sum().backward()
        loaded.model.zero_grad(set_to_none=True)
        assert graphs.captures == captures + 3, f"{name} training={training}: not captured (see the log)"
        replays = graphs.replays
        for i, label in enumerate(["tree", "unshared", "tree", "groups", "unshared"]):
            layout = layouts[label][1]
            with torch.set_grad_enabled(training):
                out = run_packed(loaded.model, layout, loaded.config)
                eager = run_packed(loaded.model, layout, eager_config)
            assert torch.equal(out.detach(), eager.detach()), f"{name} {label} training={training}: logits differ"
            if training:
                _gradient_within_eager_spread(loaded.model, layout, eager_config, out, eager, i, f"{name} {label}, replay {i}")
        assert graphs.replays == replays + 5
        pool = graphs.pools[training]
        print(f"{name} training={training}: one pool of {pool.nbytes / 2**20:.1f} MiB holds {len(pool.tokens)} graphs "
              f"of {sorted(pool.tokens.values())} tokens")


def test_a_graphs_memory_is_its_pools_segments_and_the_share_holds(tmp_path):
    """The process's graphs are counted by their memory pools' segments (at least the captured output's
    bytes, at most what the allocator reserved); under a share of half that pool a second structure gets
    no graph (its size predicted from the first's bytes per token, the first still in use) and runs
    eagerly, with the same logits."""
    from ps_bridge.cuda_graphs import MEMORY
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

    loaded = _loaded("qwen2.5", tmp_path)
    graphs = model_graphs(loaded.model)
    samples = grpo_like_samples(loaded.vocab_size, num_prompts=3, n=4, prompt_len=(20, 90), response_len=(1, 40), seed=3)
    layout = build_layout(samples, share=True, pad_multiple=8, vocab_size=loaded.vocab_size).to(loaded.device)
    with torch.no_grad():
        first = run_packed(loaded.model, layout, loaded.config)
        run_packed(loaded.model, layout, loaded.config)
        (key, entry), = graphs.graphs.items()
        held = MEMORY.pool_bytes(graphs.pools[False])
        assert entry.output.numel() * entry.output.element_size() <= held <= torch.cuda.memory_reserved()
        assert mine(MEMORY, graphs) == held
        small = replace(loaded.config, cuda_graph_memory=held / 2 / MEMORY.total())
        other = build_layout(samples, share=False, pad_multiple=8, vocab_size=loaded.vocab_size).to(loaded.device)
        outs = [run_packed(loaded.model, other, small) for _ in range(3)]
    assert list(graphs.graphs) == [key] and len(graphs.no_room) == 1 and mine(MEMORY, graphs) == held
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(first, run_packed(loaded.model, layout, replace(loaded.config, cuda_graphs=False)))
