"""F (ps_bridge.tools.bench.flops): the unshared computation's model FLOPs over the shared one's.

The one-level rows are checked against the count written out by hand for one prompt of P tokens
with n responses of R tokens, which gives DESIGN.md section 10's F of about 3.7, 10.1 and 8.0 for
the Qwen2.5-7B shape (4 layers) at (2048, 512, 8), (4096, 256, 16), (32768, 1024, 8)."""

import pytest

from ps_bridge.tools.bench.catalog import MODEL_SHAPES, make_samples
from ps_bridge.tools.bench.flops import flop_ratio, flop_shape, model_flops
from ps_bridge.layout import Sample, build_layout


def one_level_ratio_by_hand(dims, layers, P, R, n):
    h, V, I = dims["hidden_size"], dims["vocab_size"], dims["intermediate_size"]
    H, Hkv = dims["num_attention_heads"], dims["num_key_value_heads"]
    d = h // H
    linear = 2 * (h * H * d + 2 * h * Hkv * d + H * d * h + 3 * h * I)  # q, k, v, o, gated MLP

    def flops(tokens, pairs, outputs):
        return layers * (3 * tokens * linear + 3.5 * 4 * H * d * pairs) + 3 * 2 * h * V * outputs

    unshared = flops(n * (P + R), n * (P + R) ** 2 / 2, n * (P + R))
    shared = flops(P + n * R, P**2 / 2 + n * (R * P + R**2 / 2), 1 + n * R)
    return unshared / shared


@pytest.mark.parametrize("P, R, n, documented", [(2048, 512, 8, 3.7), (4096, 256, 16, 10.1), (32768, 1024, 8, 8.0)])
def test_one_level_rows_match_the_formula_and_design(P, R, n, documented):
    model = MODEL_SHAPES["qwen2.5-7b"]
    samples = make_samples(P, R, n, 1, 1000, 0)
    F = flop_ratio(flop_shape(model), samples, share=True)
    expected = one_level_ratio_by_hand(model.dims, model.bench_layers, P, R, n)
    assert F == pytest.approx(expected, rel=1e-12)
    assert F == pytest.approx(documented, abs=0.1)  # DESIGN.md section 10: "about"
    # the output layer on read positions only: F exceeds the token ratio S
    assert F > n * (P + R) / (P + n * R)


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-8b", "qwen3-30b-a3b"])
def test_no_sharing_gives_one_and_trees_gain(name):
    shape = flop_shape(MODEL_SHAPES[name])
    # nothing shared: the shared run saves the output layer on the prompt positions not read only
    distinct = [Sample([1, 2, 3], [4, 5]), Sample([2, 3], [4])]
    unshared = model_flops(shape, build_layout(distinct, share=False))
    not_read = (3 - 1) + (2 - 1)
    by_hand = unshared / (unshared - 3 * 2 * shape.hidden * shape.vocab * not_read)
    assert flop_ratio(shape, distinct, share="tree", min_shared=0) == pytest.approx(by_hand, rel=1e-12)
    system = list(range(10, 74))
    tree = [Sample(system + [p] * 8, [r] * 16) for p in range(4) for r in range(4)]
    one_level = flop_ratio(shape, tree, share=True)
    deep = flop_ratio(shape, tree, share="tree", min_shared=0)
    assert 1.0 < one_level < deep  # the system prompt is shared across prompts only by the tree


def test_padding_is_counted():
    shape = flop_shape(MODEL_SHAPES["qwen2.5-7b"])
    samples = [Sample([1, 2, 3], [4, 5])]
    tight, padded = build_layout(samples, share=False), build_layout(samples, share=False, pad_multiple=8)
    assert model_flops(shape, padded) > model_flops(shape, tight)


def test_system_prompt_tree_matches_the_formula():
    """A system prompt of S tokens shared by G prompts of P tokens, each with n responses of R: the
    tree's FLOPs written out by hand (two levels of ancestors for the responses)."""
    model = MODEL_SHAPES["qwen2.5-7b"]
    S, G, P, n, R = 96, 3, 40, 4, 24
    system = list(range(S))
    samples = [Sample(system + [500 + g] * P, [1000 + 10 * g + r] * R) for g in range(G) for r in range(n)]
    d = model.dims
    h, V, I = d["hidden_size"], d["vocab_size"], d["intermediate_size"]
    H, Hkv = d["num_attention_heads"], d["num_key_value_heads"]
    hd = h // H
    linear = 2 * (h * H * hd + 2 * h * Hkv * hd + H * hd * h + 3 * h * I)

    def flops(tokens, pairs, outputs):
        return model.bench_layers * (3 * tokens * linear + 3.5 * 4 * H * hd * pairs) + 3 * 2 * h * V * outputs

    L = S + P + R
    unshared = flops(G * n * L, G * n * L**2 / 2, G * n * L)
    pairs = S**2 / 2 + G * (P * S + P**2 / 2) + G * n * (R * (S + P) + R**2 / 2)
    shared = flops(S + G * P + G * n * R, pairs, G + G * n * R)
    F = flop_ratio(flop_shape(model), samples, share="tree", min_shared=0)
    assert F == pytest.approx(unshared / shared, rel=1e-12)
    assert build_layout(samples, share="tree", min_shared=0).tree_depth == 2


def test_flops_by_kind_split_the_count():
    """`flops_by_kind`: the routed experts apart from the dense matmuls (the output layer among them, on
    the read positions), attention's quadratic term in attention layers only, the delta rule in Gated
    DeltaNet layers only; `model_flops` is their sum."""
    from ps_bridge.tools.bench.flops import flops_by_kind, output_positions

    samples = make_samples(64, 16, 4, 2, 1000, 0)
    for name in ("qwen2.5-7b", "qwen3.5-9b", "qwen3.5-35b-a3b"):
        shape = flop_shape(MODEL_SHAPES[name], 4)
        for layout in (build_layout(samples, share=False), build_layout(samples, share="tree", prompt_values=False)):
            kinds = flops_by_kind(shape, layout)
            assert sum(kinds.values()) == model_flops(shape, layout)
            T, gdn_layers = layout.num_tokens, shape.layer_kinds.count("gdn")
            assert kinds["experts"] == pytest.approx(4 * T * 3 * 2 * 3 * shape.hidden * shape.expert_intermediate
                                                     * shape.experts_per_token)
            assert (kinds["experts"] > 0) == (name == "qwen3.5-35b-a3b")
            assert (kinds["gdn"] > 0) == (gdn_layers > 0) and kinds["vision"] == 0
            assert (kinds["attention"] > 0) == ("attention" in shape.layer_kinds)
            output = 3 * 2 * shape.hidden * shape.vocab * output_positions(layout)
            mixers = sum(3 * T * shape.linear_flops_per_token(k) for k in shape.layer_kinds)
            assert kinds["dense"] == pytest.approx(mixers - kinds["experts"] + output)
        assert output_positions(layout) == layout.output_positions.numel() < layout.num_tokens
    # bucketed, the output layer runs on the positions the rows read, not on the bucket's padding
    uneven = [Sample(s.prompt, s.response[: 5 + i % 11]) for i, s in enumerate(samples)]
    tight = build_layout(uneven, share="tree", prompt_values=False)
    bucketed = build_layout(uneven, share="tree", prompt_values=False, bucket=True)
    assert output_positions(bucketed) == output_positions(tight) < bucketed.output_positions.numel()


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-8b", "qwen3-30b-a3b"])
def test_flop_shape_of_a_config_reads_the_family_off_it(name):
    """`flop_shape_of_config` (verl-check's F, from a checkpoint's config) equals the bench's shape of
    the same catalogue model, the family read off the config."""
    from ps_bridge.tools.bench.catalog import FAMILIES
    from ps_bridge.tools.bench.flops import flop_shape_of_config

    model = MODEL_SHAPES[name]
    assert flop_shape_of_config(FAMILIES[model.family](model.dims, 4)) == flop_shape(model, 4)


def test_verl_check_phase_flops_count_each_micro_batch_once():
    """verl-check's `PhaseFlops` (the shared engine's layout observer): a phase's count is the sum over
    its micro-batches; F over the steps leaves the first out, as the speed-ups do."""
    from ps_bridge.layout import build_layout
    from ps_bridge.tools.verl_check.flops import PhaseFlops, flop_ratios

    shape = flop_shape(MODEL_SHAPES["qwen2.5-7b"], 2)
    groups = [[Sample([1] * 64 + [g], [2 + r] * (8 + r)) for r in range(4)] for g in range(3)]
    counter = PhaseFlops(shape)
    for group in groups:  # three micro-batches of one group each
        counter(group, build_layout(group, share=True, prompt_values=False))
    counts = counter.take()
    assert counter.take() == {"unshared": 0, "shared": 0}  # taken once
    everything = [s for g in groups for s in g]
    assert counts["unshared"] == pytest.approx(model_flops(shape, build_layout(everything, share=False)))
    assert counts["shared"] == pytest.approx(sum(model_flops(shape, build_layout(g, share=True, prompt_values=False))
                                                 for g in groups))
    steps = [{"flops": {"shared": {"update": {"unshared": 100.0, "shared": 1.0}}}},
             {"flops": {"shared": {"update": {"unshared": 6.0, "shared": 2.0}}}},
             {"flops": {"shared": {"update": {"unshared": 4.0, "shared": 3.0}}}}]
    assert flop_ratios(steps) == {"update": pytest.approx(10.0 / 5.0)}
    assert flop_ratios([{"flops": {"shared": None}}]) is None
