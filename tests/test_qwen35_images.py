"""Qwen3.5 ConditionalGeneration with image prompts, prefix-shared, on CPU in float32.

Tiny random checkpoints (dense and MoE, a one-layer vision tower) and random images of several grid
sizes: which samples share (tokens *and* images), the vision tower once per distinct image, mRoPE
positions as transformers' `get_rope_index`, log-probs against transformers'
`Qwen3_5ForConditionalGeneration` and the unshared run, every gradient (vision tower included).
"""

import pytest
import torch

from qwen35_helpers import load_tiny, max_abs, param_grads
from image_cases import A, A2, B, C, IMAGE, MERGE, SYSTEM, VIDEO, image_batch, image_tokens, with_images
from ps_bridge.images import sequence_mrope
from ps_bridge.layout import Sample, build_layout, decide_tree, find_groups
from ps_bridge.plan import SharingPlan
from ps_bridge.rows import PackedRows
from ps_bridge.tools.runtime import forward_logits
from ps_bridge.tools.tiny_checkpoints import hf_sample_logprobs


# ---- which samples share: no model ------------------------------------------------------------

def test_equal_placeholders_of_different_images_never_share():
    samples = image_batch()
    groups = find_groups(samples)
    assert len(groups) == 4, groups  # prompts 0 and 1: equal tokens, different images
    shared = build_layout(samples, share=True)
    # the tower's inputs: A, A2, B, C once each (A's rows read by prompts 0 and 3); 5 image runs packed
    assert shared.num_groups == 4 and shared.images.num_images == 4 and shared.images.occurrences == 15
    assert shared.images.image_positions.numel() == 2 * A.num_tokens(MERGE) + A2.num_tokens(MERGE) + B.num_tokens(MERGE) + C.num_tokens(MERGE)
    # without images the same tokens are one prompt
    text = [Sample(s.prompt, s.response) for s in samples]
    assert len(find_groups(text)) == 3


def test_tree_shares_the_system_prompt_only_across_different_images():
    # prompts equal in tokens up to the end; images differ: only SYSTEM + <vision_start> is common
    samples = [with_images(Sample(SYSTEM + image_tokens(im) + [7, 8], [9, r]), [im], index=i)
               for i, (im, r) in enumerate([(A, 1), (A2, 2), (A, 3)])]
    tree = decide_tree(samples, "tree", min_shared=0)
    root = [n for n in range(tree.num_nodes) if tree.node_parent[n] < 0]
    assert len(root) == 1 and tree.node_end[root[0]] - tree.node_start[root[0]] == len(SYSTEM) + 1
    layout = build_layout(samples, share="tree", min_shared=0)
    # samples 0 and 2 share A's placeholders and the question; sample 1 has its own A2 run
    assert layout.images.num_images == 2 and layout.images.image_positions.numel() == 2 * A.num_tokens(MERGE)


def test_plan_does_not_reuse_a_tree_decided_for_other_images():
    samples = image_batch()
    plan = SharingPlan(share="tree").for_samples(samples)
    assert plan.holds_tree_of(samples, None)
    swapped = [with_images(Sample(s.prompt, s.response), [A2] if s.images[0].image is A else [sp.image for sp in s.images], index=i)
               for i, s in enumerate(samples)]
    assert not plan.holds_tree_of(swapped, None)


def test_placeholder_count_mismatch_and_videos_refused_naming_the_sample():
    with pytest.raises(ValueError, match=r"^sample 7: 1 image placeholder run\(s\) \(token id 250\) for 2 image\(s\)$"):
        with_images(Sample(SYSTEM + image_tokens(A), [1]), [A, B], index=7)
    with pytest.raises(ValueError, match=r"^sample 3: image 0 \(grid \(1, 2, 4\), merge 2\) needs 2 placeholder tokens, its run has 6$"):
        with_images(Sample(SYSTEM + image_tokens(A), [1]), [B], index=3)
    with pytest.raises(ValueError, match=r"^sample 2: video placeholder tokens"):
        with_images(Sample(SYSTEM + [VIDEO, VIDEO], [1]), [], index=2)


# ---- the model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen3.5-vl", "qwen3.5-moe-vl"])
def tiny(request, tmp_path_factory):
    hf, loaded, path = load_tiny(request.param, tmp_path_factory)
    loaded.model.eval()  # eval: no MoE aux loss in the log-prob gradients compared below
    return request.param, hf, loaded


def logprobs(loaded, samples, share, pad_multiple=1):
    layout = build_layout(samples, share=share, pad_multiple=pad_multiple, vocab_size=loaded.vocab_size, min_shared=0)
    rows = PackedRows.of(layout)
    return rows.responses(rows.logprobs(forward_logits(loaded, layout)))


def test_mrope_positions_equal_transformers_get_rope_index(tiny):
    _, hf, _ = tiny
    for s in image_batch(n=1):
        ids = torch.tensor([s.prompt + s.response])
        expected, _ = hf.model.get_rope_index(
            ids, mm_token_type_ids=(ids == IMAGE).int(),
            image_grid_thw=torch.tensor([span.image.grid_thw for span in s.images]))
        assert torch.equal(torch.from_numpy(sequence_mrope(ids.shape[1], s.images)), expected[:, 0])


@pytest.mark.parametrize("share,pad_multiple", [(True, 1), ("tree", 1), (True, 4), ("tree", 3)])
def test_image_logprobs_equal_hf_and_unshared(tiny, share, pad_multiple):
    name, hf, loaded = tiny
    samples = image_batch()
    with torch.no_grad():
        shared = logprobs(loaded, samples, share, pad_multiple)
        unshared = logprobs(loaded, samples, False)
        ref = hf_sample_logprobs(hf, samples)
    assert max_abs(shared, ref) <= 2e-5, (name, max_abs(shared, ref))
    assert max_abs(shared, unshared) <= 2e-5, (name, max_abs(shared, unshared))


def test_vision_tower_once_per_distinct_image(tiny):
    _, _, loaded = tiny
    samples = image_batch()
    seen = []
    hook = loaded.model.vision_model.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(kwargs["grid_thw"].tolist()), with_kwargs=True)
    try:
        with torch.no_grad():
            logprobs(loaded, samples, True)
            logprobs(loaded, samples, False)
    finally:
        hook.remove()
    shared, unshared = seen
    assert sorted(map(tuple, shared)) == sorted([A.grid_thw, A2.grid_thw, B.grid_thw, C.grid_thw])
    # the unshared (stock) computation runs every image of every sample: 3 responses x 5 images
    assert len(unshared) == 15


def test_gradients_shared_equal_unshared_vision_tower_included(tiny):
    name, _, loaded = tiny
    samples = image_batch()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s.response), generator=gen) for s in samples]
    g_shared = param_grads(loaded, samples, True, weights, pad_multiple=2)
    g_unshared = param_grads(loaded, samples, False, weights, pad_multiple=2)
    g_tree = param_grads(loaded, samples, "tree", weights)
    assert g_shared.keys() == g_unshared.keys() == g_tree.keys()
    vision = [n for n in g_shared if n.startswith("vision_model.")]
    assert any("merger" in n for n in vision) and any("patch_embed" in n for n in vision), vision
    for other in (g_shared, g_tree):
        worst = max(((other[n] - g_unshared[n]).abs().max() / g_unshared[n].abs().max().clamp(min=1e-12)).item()
                    for n in g_unshared)
        assert worst <= 1e-5, (name, worst)


def test_sharing_from_token_ids_alone_would_be_wrong(tiny, monkeypatch):
    """Negative check: if sharing compared token ids only, prompts 0 and 1 (equal placeholders,
    different images) would share, and their log-probs would no longer equal transformers'."""
    import ps_bridge.layout as layout_module

    _, hf, loaded = tiny
    samples = image_batch()
    monkeypatch.setattr(layout_module, "prompt_image_signature", lambda s: ())
    monkeypatch.setattr(layout_module, "sharing_keys", lambda samples, flat, offsets: flat)
    with torch.no_grad():
        wrong = logprobs(loaded, samples, True)
        ref = hf_sample_logprobs(hf, samples)
    assert build_layout(samples, share=True).num_groups == 3
    assert max_abs(wrong, ref) > 1e-3


@pytest.fixture
def hf_recurrent_gated_delta_rule(tiny, monkeypatch):
    """transformers' Qwen3.5 runs the gated delta rule (without fla-core) through its chunked torch
    reference, whose float32 gradients carry cancellation errors of 1e-5..4e-3 relative
    (tests/test_qwen35_model.py, DECAY_GATE); every gradient upstream of the GDN layers (the vision
    tower's here) inherits them. Its token-by-token reference (`torch_recurrent_gated_delta_rule`,
    same module) has none: the HF model takes it for this comparison."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35

    def recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        assert cu_seqlens is None  # one sequence per call (hf_sample_logprobs)
        return hf_qwen35.torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state,
                                                          output_final_state, use_qk_l2norm_in_kernel)

    _, hf, _ = tiny
    for module in hf.modules():
        if hasattr(module, "chunk_gated_delta_rule"):  # the GDN layers (dense and MoE models)
            monkeypatch.setattr(module, "chunk_gated_delta_rule", recurrent)


def test_gradients_equal_hf_gradients_vision_tower_included(tiny, hf_recurrent_gated_delta_rule):
    from ps_bridge.tools.compare import hf_gradient_difference

    name, hf, loaded = tiny
    r = hf_gradient_difference(loaded, hf, image_batch(n=2))
    per = r["per_parameter"]
    vision = {n: d for n, d in per.items() if ".visual." in n}
    assert vision and any("merger" in n for n in vision), sorted(per)
    worst = sorted(per.items(), key=lambda kv: -kv[1])[:5]
    print(name, worst)
    assert max(per.values()) <= 1e-5, (name, worst)
