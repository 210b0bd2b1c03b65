"""Level buckets (`build_layout(bucket=True, level_buckets=True)`, `PS_BRIDGE_CUDA_GRAPH_BUCKETS=level`), on the CPU.

Segments keep their own lengths and each tree level's block of the pack is padded to a bucket; the
Gated DeltaNet runs each level as its segments and filler sequences, so that every varlen call's
sequence and chunk counts follow the tree and the blocks only (`ps_bridge.tree.level_buckets`).
Checked here: the filler arithmetic over random and extreme levels; layouts of other lengths in the
same blocks share a `structure_key`; the padding and the fillers change no log-prob or gradient
(against the unbucketed pack and Hugging Face, with the reference attention and with the cascade on
torch's CPU flash kernel); a replay (the capture replaced by a recording stand-in, as in
test_cuda_graphs.py) on layouts of other lengths equals the eager run on each, exactly, with and
without gradients, and the reference attention, which reads per-token segment ids that follow the
lengths, is refused; the sharing rule counts the level-bucketed pack.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from ps_bridge.config import PrefixSharingConfig
from ps_bridge import cuda_graphs
from ps_bridge.cuda_graphs import ModelGraphs, graph_refusal
from ps_bridge.forward import _run
from ps_bridge.kernels.gdn import plan_from_layout
from ps_bridge.layout import build_layout
from ps_bridge.tools.tiny_checkpoints import grpo_like_samples
from ps_bridge.tree.level_buckets import (
    CHUNK, PADDING_PIECES, RECENT_SHAPES, LevelShape, RecentShapes, chunk_index, chunks, filler_count, filler_lengths,
    largest_block, level_block_length, level_bucket, level_sequences, own_shape, segment_bound,
)
from qwen35_helpers import load_tiny
from test_cuda_graphs import record
from test_cuda_graphs_buckets import (_forward, assert_bucketing_changes_nothing, assert_read_positions_bucketed,
                                       assert_replays_equal_eager)


@pytest.fixture(autouse=True)
def fresh_shapes():
    """Each test packs with no recent shapes of an earlier one in view (`RECENT_SHAPES`)."""
    RECENT_SHAPES.clear()
    yield
    RECENT_SHAPES.clear()


# ---- the arithmetic --------------------------------------------------------------------------

def test_level_buckets_pad_at_most_an_eighth_above_1024():
    assert [level_bucket(n) for n in (1, 64, 65, 1023, 1024, 1025, 2048, 2049, 9000)] == [
        64, 64, 128, 1024, 1024, 1152, 2048, 2304, 9216]
    for n in range(1, 20000, 7):
        b = level_bucket(n)
        assert n <= b and b % CHUNK == 0 and (b - n < CHUNK or 8 * (b - n) < b)


def test_largest_block_bounds_every_block_of_the_level():
    for segments in (1, 4, 63, 64, 200):
        for tokens in range(segments, 40000, 7):
            block = level_block_length(tokens, segments)
            assert block <= largest_block(tokens, segments)
            assert block - tokens - filler_count(segments) <= max(63, (tokens + filler_count(segments)) // 8)


def test_filler_lengths_hold_the_tokens_and_chunks():
    for padding in range(0, 300):
        for chunk_count in range(-(-padding // 64), min(padding, 12) + 1):
            lengths = filler_lengths(padding, chunk_count, 12)
            assert len(lengths) == 12 and sum(lengths) == padding
            assert sum(chunks(n) for n in lengths) == chunk_count
    with pytest.raises(ValueError):
        filler_lengths(10, 0, 4)
    with pytest.raises(ValueError):
        filler_lengths(10, 11, 20)  # more chunks than tokens


def _fixed_shape(lengths, block):
    seqs = level_sequences(lengths, block)
    s = len(lengths)
    assert seqs[:s] == list(lengths) and sum(seqs) == block and min(seqs) >= 0
    assert len(seqs) == s + filler_count(s)
    assert len(chunk_index(seqs)) == chunks(block) + s


def test_every_level_runs_in_one_shape():
    rng = random.Random(0)
    for _ in range(5000):
        s = rng.randint(1, 140)
        lengths = [rng.choice([1, 63, 64, 65, 128, rng.randint(1, 700)]) for _ in range(s)]
        _fixed_shape(lengths, level_block_length(sum(lengths), s))
        _fixed_shape(lengths, sum(lengths) + filler_count(s))  # the tightest block
    for s in (1, 8, 63, 64, 130):
        for n in (1, 63, 64, 65, 127, 128, 129):
            _fixed_shape([n] * s, sum([n] * s) + filler_count(s))
    with pytest.raises(ValueError, match="holds no"):
        level_sequences([10, 10], 20 + filler_count(2) - 1)


def test_fewer_fillers_do_not_always_do():
    # as many fillers as segments: segments of whole chunks in the tightest block leave the fillers
    # more chunks than that many hold
    s, lengths = 8, [CHUNK] * 8
    block = sum(lengths) + filler_count(s)
    want = chunks(block) + s - sum(chunks(n) for n in lengths)
    with pytest.raises(ValueError, match="fillers hold"):
        filler_lengths(block - sum(lengths), want, s)


# ---- layouts ----------------------------------------------------------------------------------

def _samples(seed, num_prompts=3, n=3, system=0, response_len=(5, 60)):
    samples = grpo_like_samples(200, num_prompts=num_prompts, n=n, prompt_len=(17, 24), response_len=response_len,
                                seed=seed, shuffle=False)
    head = list(range(100, 100 + system))
    return [replace(s, prompt=head + s.prompt) for s in samples]


SHARES = {"unshared": (False, 0), "groups": (True, 0), "tree": ("tree", 0), "system": ("tree", 20)}


def _level(samples, share, **kw):
    return build_layout(samples, share=share, vocab_size=200, min_shared=0, bucket=True, level_buckets=True, **kw)


def _same_blocks(case, count=4, prompt_values=True, **kw):
    """`count` level-bucketed layouts of `case` with other lengths and the same blocks (and, without
    `prompt_values`, the same count of read positions)."""
    share, system = SHARES[case]
    found, keys = [], set()

    def shape(layout):
        outputs = layout.output_positions
        return layout.host["level_blocks"], None if outputs is None else outputs.numel()

    for seed in range(200):
        layout = _level(_samples(seed, system=system, **kw), share, prompt_values=prompt_values)
        if not found or shape(layout) == shape(found[0]):
            found.append(layout)
            keys.add(layout.structure_key())
        if len(found) == count:
            assert len(keys) == 1
            return found
    raise AssertionError(f"no {count} layouts of one structure found")


@pytest.mark.parametrize("case", SHARES)
def test_segments_keep_their_lengths_and_each_level_fills_its_block(case):
    share, system = SHARES[case]
    layouts = _same_blocks(case)
    assert layouts[0].tree_depth == {"unshared": 0, "groups": 1, "tree": 1, "system": 2}[case]
    for layout in layouts:
        host = layout.host
        assert layout.bucketed and layout.level_buckets and layout.output_positions is None
        offsets = host["level_offsets"]
        levels = [(sum(host["valid_lengths"][a:b]), b - a) for a, b in zip(offsets, offsets[1:])]
        # a recent pack's blocks hold it with no more padding than its own blocks could have
        most = max(sum(level_block_length(*level) for level in levels), sum(largest_block(*level) for level in levels))
        for d, block in enumerate(host["level_blocks"]):
            lo, hi = host["level_offsets"][d], host["level_offsets"][d + 1]
            assert host["padded_lengths"][lo:hi - 1] == host["valid_lengths"][lo:hi - 1]
            assert sum(host["padded_lengths"][lo:hi]) == block
            own = level_block_length(*levels[d])
            assert own <= block and (block == own or sum(host["level_blocks"]) <= most)
    assert layouts[0].host["valid_lengths"] != layouts[1].host["valid_lengths"]
    # another block, another structure; segment buckets are another structure too
    longer = _samples(0, system=system)
    longer[-1] = replace(longer[-1], response=longer[-1].response + [1] * 200)
    assert _level(longer, share).structure_key() != layouts[0].structure_key()
    segment = build_layout(_samples(0, system=system), share=share, vocab_size=200, min_shared=0, bucket=True)
    assert segment.structure_key() != layouts[0].structure_key()


def test_the_causal_call_is_bounded_by_its_longest_element_not_the_block():
    """The causal attention call's grid follows its declared longest element: under level buckets that
    is the power of two above the longest segment or padding piece (`host["segment_bound"]`, in the
    key), far below a level's block where a level holds many segments; every element fits it."""
    from ps_bridge.kernels.attention.cascade import cascade_plan

    samples = grpo_like_samples(200, num_prompts=4, n=8, prompt_len=(100, 128), response_len=(100, 256), seed=0,
                                shuffle=False)
    layout = _level(samples, True)
    host = layout.host
    call = cascade_plan(layout).segments
    lengths = [b - a for a, b in zip(call.cu_q, call.cu_q[1:])]
    assert call.max_q == call.max_k == host["segment_bound"] == 1 << (max(lengths) - 1).bit_length() == 256
    assert max(host["level_blocks"]) >= 16 * host["segment_bound"]
    assert len(lengths) == layout.num_segments + PADDING_PIECES * (layout.tree_depth + 1)  # + each level's pieces
    # the bound is part of the structure: the same tokens with a longer longest response, in the same
    # blocks, are another structure
    longest = max(range(len(samples)), key=lambda i: len(samples[i].response))
    shortest = min(range(len(samples)), key=lambda i: len(samples[i].response))
    moved = len(samples[shortest].response) - 1
    other = list(samples)
    other[longest] = replace(samples[longest], response=samples[longest].response + [7] * moved)
    other[shortest] = replace(samples[shortest], response=samples[shortest].response[:1])
    RECENT_SHAPES.clear()
    longer = _level(other, True)
    assert longer.host["level_blocks"] == host["level_blocks"] and longer.host["segment_bound"] == 512
    assert longer.structure_key() != layout.structure_key()


def test_a_pack_takes_a_recent_shape_that_holds_it_with_little_more_padding():
    recent = RecentShapes(recent=2, tree_shapes=2)
    big = [[100] * 4, [260] * 30]
    mine = recent.choose("groups", big)
    assert mine == own_shape(big) and recent.choose("groups", big) == mine  # asked twice: one answer
    smaller = [[100] * 4, [250] * 30]
    assert own_shape(smaller).blocks < mine.blocks
    assert sum(mine.blocks) <= largest_block(400, 4) + largest_block(30 * 250, 30)
    assert recent.choose("groups", smaller) == mine  # held, with no more padding than its own blocks could have
    # within 1/8 of its own blocks but with more padding than they could have (7540 tokens in 8640): its own
    rounded = [[100] * 4, [238] * 30]
    assert 8 * sum(mine.blocks) <= 9 * sum(own_shape(rounded).blocks)
    assert sum(mine.blocks) > largest_block(400, 4) + largest_block(30 * 238, 30)
    assert recent.choose("groups", rounded) == own_shape(rounded)
    much_smaller = [[100] * 4, [200] * 30]
    assert recent.choose("groups", much_smaller) == own_shape(much_smaller)  # more than 1/8: its own
    assert recent.choose("other tree", smaller) == own_shape(smaller)  # another tree shape: its own
    longer = [[100] * 4, [250] * 29 + [600]]  # a longer segment than the recent bound holds
    assert segment_bound(longer, mine.blocks) > mine.bound
    assert recent.choose("groups", longer) != mine
    # bounded memory: the least recent tree shape, and a tree shape's oldest shapes, are forgotten
    assert list(recent._shapes["groups"]) == [own_shape(much_smaller), own_shape(longer)]
    recent.choose("third tree", big)
    assert list(recent._shapes) == ["groups", "third tree"]
    assert LevelShape(mine.blocks, mine.bound) == mine
    # levels of few tokens: their own blocks (at least 64 tokens each) pad them by more than 1/8, and
    # a pack still takes its own shape, remembered once
    few = [[10] * 2, [20] * 4]
    assert 8 * sum(own_shape(few).blocks) > 9 * 100
    assert recent.choose("few", few) == recent.choose("few", few) == own_shape(few)
    assert list(recent._shapes["few"]) == [own_shape(few)]


def test_layouts_of_nearby_totals_share_a_structure():
    """Packed one after the other, a micro-batch whose blocks a recent one's hold (within 1/8 more
    tokens) is packed in them: the same structure key, so the same CUDA graph."""
    found = {}
    for seed in range(60):
        layout = _level(_samples(seed, response_len=(40, 60)), True)
        found.setdefault(layout.structure_key(), []).append(layout)
    alone = set()
    for seed in range(60):
        RECENT_SHAPES.clear()  # each packed in its own shape
        alone.add(_level(_samples(seed, response_len=(40, 60)), True).structure_key())
    assert len(found) < len(alone)


def test_level_buckets_need_buckets():
    with pytest.raises(ValueError, match="needs bucket=True"):
        build_layout(_samples(0), share=True, vocab_size=200, level_buckets=True)


@pytest.mark.parametrize("case", ["groups", "system"])
def test_the_gdn_plan_runs_each_level_as_its_segments_and_fillers(case):
    layouts = _same_blocks(case, count=2)
    plans = [plan_from_layout(layout) for layout in layouts]
    for layout, plan in zip(layouts, plans):
        host = layout.host
        assert plan.gather_index is None and plan.num_input_tokens == layout.num_tokens
        for d, level in enumerate(plan.levels):
            lo, hi = host["level_offsets"][d], host["level_offsets"][d + 1]
            lengths = torch.diff(level.cu).tolist()
            assert lengths[:hi - lo] == host["valid_lengths"][lo:hi] and level.fillers == filler_count(hi - lo)
            assert level.cu_host is None and level.chunk_index.tolist() == chunk_index(lengths)
            assert level.end - level.start == host["level_blocks"][d]
        assert plan.cu_all_host is None and plan.conv_chunk_index.shape[0] == sum(
            level.chunk_index.shape[0] for level in plan.levels)
    # one shape, other offsets
    for a, b in zip(*(p.levels for p in plans)):
        assert a.cu.shape == b.cu.shape and a.chunk_index.shape == b.chunk_index.shape
    assert any(not torch.equal(a.cu, b.cu) for a, b in zip(plans[0].levels, plans[1].levels))


# ---- exactness --------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen2.5", "qwen3.5"])
def tiny(request, tmp_path_factory):
    hf, loaded, _ = load_tiny(request.param, tmp_path_factory)
    return hf, loaded


def _config(loaded, backend):
    return replace(loaded.config, backend=backend)


@pytest.mark.parametrize("backend", ["torch_ref", "flash_atten_gpu"])
@pytest.mark.parametrize("case", SHARES)
def test_level_bucketed_log_probs_and_gradients_equal_the_unbucketed_pack_and_hf(tiny, case, backend):
    hf, loaded = tiny
    share, system = SHARES[case]
    assert_bucketing_changes_nothing(hf, loaded, _samples(3, system=system), share, _config(loaded, backend),
                                     bucket=True, level_buckets=True)


@pytest.mark.parametrize("backend", ["torch_ref", "flash_atten_gpu"])
def test_segments_padded_to_a_multiple_and_a_padded_pack_change_nothing(tiny, backend):
    """`pad_multiple` pads each segment (the Gated DeltaNet runs that padding with its decay and write
    strength zeroed) and `total_multiple` the pack's last level."""
    hf, loaded = tiny
    assert_bucketing_changes_nothing(hf, loaded, _samples(3, system=20), "tree", _config(loaded, backend),
                                     bucket=True, level_buckets=True, pad_multiple=4, total_multiple=24)


@pytest.mark.parametrize("case", SHARES)
def test_a_replay_on_other_lengths_equals_eager(tiny, case):
    _, loaded = tiny
    config = replace(_config(loaded, "flash_atten_gpu"), cuda_graphs=True, cuda_graph_buckets="level")
    assert_replays_equal_eager(loaded.model, config, _same_blocks(case), training=False)


@pytest.mark.parametrize("case", ["unshared", "system"])
def test_a_training_replay_on_other_lengths_equals_eager(tiny, case):
    _, loaded = tiny
    config = replace(_config(loaded, "flash_atten_gpu"), cuda_graphs=True, cuda_graph_buckets="level")
    assert_replays_equal_eager(loaded.model, config, _same_blocks(case, count=3), training=True)


@pytest.mark.parametrize("case", ["groups", "system"])
def test_level_bucketed_read_positions_change_nothing(tiny, case):
    hf, loaded = tiny
    share, system = SHARES[case]
    assert_bucketing_changes_nothing(hf, loaded, _samples(3, system=system), share, _config(loaded, "flash_atten_gpu"),
                                     bucket=True, level_buckets=True, prompt_values=False)


@pytest.mark.parametrize("training", [False, True])
def test_a_level_bucketed_replay_refills_the_read_positions(tiny, training):
    _, loaded = tiny
    config = replace(_config(loaded, "flash_atten_gpu"), cuda_graphs=True, cuda_graph_buckets="level")
    layouts = _same_blocks("system", count=3, prompt_values=False)
    assert_read_positions_bucketed(layouts)
    assert_replays_equal_eager(loaded.model, config, layouts, training=training)


def test_the_reference_attention_does_not_replay_level_buckets(tiny, monkeypatch):
    """torch_ref reads per-token segment and group ids, which follow the lengths under level buckets
    and are not refilled: its replay on another layout is wrong, and `graph_refusal` refuses it."""
    _, loaded = tiny
    config = replace(loaded.config, cuda_graphs=True, cuda_graph_buckets="level")
    layouts = _same_blocks("groups", count=3)
    graphs = ModelGraphs(capture=record)
    with torch.no_grad():
        got = [graphs.run(loaded.model, layout, ("torch_ref",), _forward(loaded.model, config)) for layout in layouts]
        want = _run(loaded.model, layouts[2], config)
    assert graphs.replays == 2 and not torch.equal(got[2], want)
    on_cuda = layouts[0]
    monkeypatch.setattr(type(on_cuda), "device", property(lambda self: torch.device("cuda")))
    assert "'torch_ref' on a level-bucketed layout" in graph_refusal(loaded.model, on_cuda, "torch_ref")
    assert graph_refusal(loaded.model, on_cuda, "flash_atten_gpu") is None
    # `auto` as it resolves for the model: the reference for this float32 model, the cascade in bf16
    assert "'auto' (here 'torch_ref') on a level-bucketed layout" in graph_refusal(loaded.model, on_cuda, "auto")
    asked = []
    monkeypatch.setattr(cuda_graphs, "choose_attention_backend",
                        lambda device, dtype, head_dim: asked.append((device.type, dtype, head_dim)) or "flash_atten_gpu")
    assert graph_refusal(loaded.model, on_cuda, "auto") is None
    assert asked == [("cuda", torch.float32, loaded.model.config.kv_channels)]


# ---- the rule and the option ------------------------------------------------------------------

def test_the_rule_counts_the_level_bucketed_pack():
    from ps_bridge.layout import decide_tree
    from ps_bridge.plan import SharingPlan
    from ps_bridge.prepare import micro_batch_layout
    from ps_bridge.tree.materialize import bucketed_tokens
    from ps_bridge.tree.order import pack_order

    # uneven responses: segment buckets pad every response to the longest one's bucket
    uneven = grpo_like_samples(200, num_prompts=3, n=8, prompt_len=(100, 120), response_len=(10, 200), seed=0,
                               shuffle=False)
    for total_multiple in (1, 24):
        tree = decide_tree(uneven, "tree", vocab_size=200, min_shared=0)
        level = _level(uneven, "tree", total_multiple=total_multiple)
        assert bucketed_tokens(tree, pack_order(tree), 1, total_multiple, level_buckets=True) == level.num_tokens
    segment = build_layout(uneven, share="tree", vocab_size=200, min_shared=0, bucket=True)
    level = _level(uneven, "tree")
    assert segment.num_tokens * 10 > segment.tokens_unshared * 9 >= level.num_tokens * 10

    config = PrefixSharingConfig(enabled=True, cuda_graphs=True, cuda_graph_buckets="level")
    plan = SharingPlan.from_config(config, 1, bucket=True)
    assert plan.level_buckets
    layout, decision = micro_batch_layout(uneven, config, None, "cuda", "bfloat16", plan=plan, vocab_size=200,
                                          total_multiple=1)
    assert decision.share and decision.bucketed and layout.level_buckets
    assert layout.num_tokens == _level(uneven, "tree").num_tokens
    assert not SharingPlan.from_config(replace(config, cuda_graph_buckets="segment"), 1, bucket=True).level_buckets


def test_the_option_reads_its_environment_variable(monkeypatch):
    monkeypatch.setenv("PS_BRIDGE_CUDA_GRAPH_BUCKETS", "level")
    assert PrefixSharingConfig.from_env().cuda_graph_buckets == "level"
    monkeypatch.delenv("PS_BRIDGE_CUDA_GRAPH_BUCKETS")
    assert PrefixSharingConfig.from_env().cuda_graph_buckets == "segment"
    monkeypatch.setenv("PS_BRIDGE_CUDA_GRAPH_BUCKETS", "levels")
    with pytest.raises(ValueError, match="PS_BRIDGE_CUDA_GRAPH_BUCKETS.*segment, level"):
        PrefixSharingConfig.from_env()
