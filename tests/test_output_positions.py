"""The output layer on the read positions only.

By default a prefix-shared run computes the output layer (and so log-probs and entropy) only at the
positions whose values rows read: every response position and each prompt's last position. The
other prompt positions hold exactly 0 in the rows; `PrefixSharingConfig(prompt_values=True)`
computes every position as before. Compared in fp32 on a CPU with the unshared run (which always
computes everything) and Hugging Face: response log-probs, entropy and every parameter gradient.
Multi-rank cases (gloo): TP=2 + SP (default suite), CP=2, PP=2 with tied embeddings and the option
under TP=2 + SP (`slow`); each also counts the rows the output layer ran on.
"""

import dataclasses
import os
import sys
from contextlib import contextmanager

import pytest
import torch

from ps_bridge.layout import Sample, build_layout
from ps_bridge.rows import PackedRows, chunked_vocab_parallel_entropy
from ps_bridge.tools.runtime import forward_logits, make_layout
from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import (  # noqa: E402
    MICRO_BATCHES,
    run_and_compare,
    single_rank_unshared,
    tied_checkpoint,  # noqa: F401 (fixture)
    tied_unshared_reference,  # noqa: F401 (fixture)
    unshared_reference,  # noqa: F401 (fixture)
)


def samples():
    return grpo_like_samples(256, num_prompts=3, n=3, prompt_len=(6, 18), response_len=(1, 8), seed=13)


def read_row_mask(layout) -> torch.Tensor:
    """True at row positions P_i - 1 .. P_i + R_i - 1 of every sample (what verl's losses read, plus
    the last, unlabelled one), written from the row offsets alone."""
    mask = torch.zeros(int(layout.row_offsets[-1]), dtype=torch.bool)
    for i in range(layout.num_samples):
        a, b = int(layout.row_offsets[i]), int(layout.row_offsets[i + 1])
        mask[a + int(layout.sample_prompt_length[i]) - 1 : b] = True
    return mask


@contextmanager
def with_prompt_values(loaded, value: bool):
    saved = loaded.config
    loaded.config = dataclasses.replace(saved, prompt_values=value)
    try:
        yield loaded
    finally:
        loaded.config = saved


@contextmanager
def count_output_rows(model):
    """The number of rows each call of the output layer got."""
    counts = []
    handle = model.output_layer.register_forward_hook(lambda m, inputs, out: counts.append(int(inputs[0].shape[0])))
    try:
        yield counts
    finally:
        handle.remove()


# ---- the layout ------------------------------------------------------------------------------


def test_layout_lists_each_response_position_and_each_prompts_last():
    batch = samples()
    layout = build_layout(batch, share=True, pad_multiple=4, prompt_values=False)
    mask = read_row_mask(layout)
    expected = sorted(set(layout.row_source[mask].tolist()))
    assert layout.output_positions.tolist() == expected
    groups = len({tuple(s.prompt) for s in batch})
    assert layout.output_positions.numel() == groups + sum(len(s.response) for s in batch) < layout.num_tokens
    # the default of build_layout, the option, and an unshared layout compute every position
    assert build_layout(batch, share=True).output_positions is None
    assert build_layout(batch, share=False, prompt_values=False).output_positions is None


def test_each_cp_shard_runs_its_own_read_positions():
    # the shard boundary (position 8) right after the first prompt's last token: shard 0 holds one
    # read position (that fork), shard 1 the rest
    batch = [Sample(list(range(1, 9)), [20, 21, 22]), Sample(list(range(1, 9)), [23, 24])]
    layout = build_layout(batch, share=True, total_multiple=4, prompt_values=False)
    assert layout.num_tokens == 16
    shards = [layout.cp_shard(r, 2) for r in range(2)]
    local = [layout.local_output_positions(s) for s in shards]
    assert local[0].tolist() == [7]
    assert (local[1] + 8).tolist() == list(range(8, 13))
    # a shard without any read position runs its first position (never zero rows), read by no row
    long_prompt = build_layout([Sample(list(range(1, 15)), [20]), Sample(list(range(1, 15)), [21])],
                               share=True, total_multiple=4, prompt_values=False)
    first = long_prompt.cp_shard(0, 2)
    assert long_prompt.local_output_positions(first).tolist() == [0]
    rows = PackedRows(long_prompt, cp_shard=first)
    assert not bool(rows.computed.any())
    assert rows.logprobs(torch.randn(1, 32)).abs().max() == 0


def test_config_option_and_environment(monkeypatch):
    from ps_bridge.config import PrefixSharingConfig

    assert PrefixSharingConfig().prompt_values is False
    assert PrefixSharingConfig().layout_prompt_values is False
    assert PrefixSharingConfig(prompt_values=True).layout_prompt_values is True
    assert PrefixSharingConfig(enabled=False).layout_prompt_values is True  # unshared: everything
    monkeypatch.setenv("PS_BRIDGE_PROMPT_VALUES", "1")
    assert PrefixSharingConfig.from_env().prompt_values is True
    monkeypatch.setenv("PS_BRIDGE_PROMPT_VALUES", "maybe")
    with pytest.raises(ValueError, match="PS_BRIDGE_PROMPT_VALUES='maybe' is not a boolean"):
        PrefixSharingConfig.from_env()


# ---- one process, fp32: rows, counts, gradients ------------------------------------------------


def _rows(loaded, layout):
    """Log-prob and entropy rows (flattened) and the number of rows the output layer ran on."""
    layout = layout.to(loaded.device)
    rows = PackedRows.of(layout)
    with count_output_rows(loaded.model) as counts:
        logits = forward_logits(loaded, layout)
    logprobs = rows.logprobs(logits)
    entropy = rows.values(chunked_vocab_parallel_entropy(logits))
    return logprobs, entropy, counts


def test_output_layer_runs_on_read_positions_and_prompt_rows_are_zero(qwen2_checkpoint, qwen2_loaded):
    _, hf_model = qwen2_checkpoint
    batch = samples()
    groups = len({tuple(s.prompt) for s in batch})
    with torch.no_grad():
        skip_layout = make_layout(batch, qwen2_loaded)
        lp, ent, counts = _rows(qwen2_loaded, skip_layout)
        with with_prompt_values(qwen2_loaded, True):
            full_layout = make_layout(batch, qwen2_loaded)
            lp_full, ent_full, counts_full = _rows(qwen2_loaded, full_layout)
        unshared_layout = make_layout(batch, qwen2_loaded, share=False)
        lp_un, ent_un, counts_un = _rows(qwen2_loaded, unshared_layout)
    assert skip_layout.output_positions is not None and full_layout.output_positions is None
    assert counts == [groups + sum(len(s.response) for s in batch)]
    assert counts_full == [skip_layout.num_tokens] and counts_un == [unshared_layout.num_tokens]
    assert counts[0] < counts_full[0]

    read = read_row_mask(skip_layout)
    # by default: the other prompt positions hold exactly 0, the read ones equal every-position's
    assert bool((lp[~read] == 0).all()) and bool((ent[~read] == 0).all())
    assert float((lp[read] - lp_full[read]).abs().max()) <= 1e-5
    assert float((ent[read] - ent_full[read]).abs().max()) <= 1e-5
    # the option: every position as the unshared computation (prompt positions included)
    assert float((lp_full - lp_un).abs().max()) <= 1e-5
    assert float((ent_full - ent_un).abs().max()) <= 1e-5
    assert float(ent_full[~read].abs().min()) > 0  # prompt entropies really computed there

    # against Hugging Face: response log-probs and entropy (row positions P-1 .. P+R-2)
    rows = PackedRows.of(skip_layout.to(qwen2_loaded.device))
    with torch.no_grad():
        for s, got_lp, got_ent in zip(batch, rows.responses(lp), rows.responses(ent)):
            ids = torch.tensor([s.prompt + s.response])
            log_p = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
            P = len(s.prompt)
            ref_lp = log_p[P - 1 : -1].gather(1, ids[0, P:, None]).squeeze(1)
            ref_ent = -(log_p.exp() * log_p).sum(-1)[P - 1 : -1]
            assert float((got_lp - ref_lp).abs().max()) <= 1e-5
            assert float((got_ent - ref_ent).abs().max()) <= 1e-5


def _gradients(loaded, layout, weights_lp, weights_ent):
    """Every parameter's gradient of sum w * logp + sum u * entropy over the response rows."""
    layout = layout.to(loaded.device)
    loaded.model.zero_grad(set_to_none=True)
    rows = PackedRows.of(layout)
    logits = forward_logits(loaded, layout)
    lp = rows.responses(rows.logprobs(logits))
    ent = rows.responses(rows.values(chunked_vocab_parallel_entropy(logits)))
    loss = sum((w * x).sum() for w, x in zip(weights_lp, lp)) + sum((u * x).sum() for u, x in zip(weights_ent, ent))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in loaded.model.named_parameters() if p.grad is not None}
    loaded.model.zero_grad(set_to_none=True)
    return grads


def test_gradients_with_the_skip_equal_unshared_and_the_option(qwen2_loaded):
    from ps_bridge.tools.compare import max_relative_grad_diff

    batch = samples()
    g = torch.Generator().manual_seed(4)
    w = [torch.rand(len(s.response), generator=g) + 0.5 for s in batch]
    u = [torch.rand(len(s.response), generator=g) for s in batch]
    skip = _gradients(qwen2_loaded, make_layout(batch, qwen2_loaded), w, u)
    unshared = _gradients(qwen2_loaded, make_layout(batch, qwen2_loaded, share=False), w, u)
    with with_prompt_values(qwen2_loaded, True):
        full = _gradients(qwen2_loaded, make_layout(batch, qwen2_loaded), w, u)
    assert set(skip) == set(unshared) == set(full)
    assert "output_layer.weight" in skip and "embedding.word_embeddings.weight" in skip
    assert max_relative_grad_diff(skip, unshared) <= 1e-5
    assert max_relative_grad_diff(skip, full) <= 1e-5


def test_gradients_with_the_skip_equal_hugging_face(qwen2_checkpoint, qwen2_loaded):
    """Every HF parameter's gradient of the log-prob loss, the shared run skipping prompt positions
    (the default `logprob_pass`)."""
    from ps_bridge.tools.compare import hf_gradient_difference

    _, hf_model = qwen2_checkpoint
    with count_output_rows(qwen2_loaded.model) as counts:
        result = hf_gradient_difference(qwen2_loaded, hf_model, samples())
    batch = samples()
    assert counts == [len({tuple(s.prompt) for s in batch}) + sum(len(s.response) for s in batch)]
    assert result["max_rel_grad_diff_vs_hf"] <= 1e-5, result["per_parameter"]


def test_labels_with_read_positions_are_refused(qwen2_loaded):
    from ps_bridge.models.packed_seq import PrefixSharedPackedSeqParams

    layout = make_layout(samples(), qwen2_loaded).to(qwen2_loaded.device)
    params = PrefixSharedPackedSeqParams.from_layout(layout)
    with pytest.raises(ValueError, match="prompt_values=True"):
        qwen2_loaded.model(input_ids=layout.tokens[None], position_ids=layout.positions[None], attention_mask=None,
                           labels=layout.tokens[None], packed_seq_params=params)


def test_qwen35_conditional_generation_language_model_runs_read_positions(tmp_path):
    """The Qwen3.5 ConditionalGeneration model's language model (Megatron-Bridge's Qwen3VLGPTModel)
    takes the selection too; its response log-probs equal the unshared run's. Skipped where the VL
    model is refused (Megatron-Bridge < 0.6.0)."""
    from qwen35_helpers import skip_where_vl_refused

    skip_where_vl_refused()
    from ps_bridge.models.qwen35_vl import PrefixSharedQwen3VLGPTModel
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    TINY_BUILDERS["qwen3.5-vl"](str(tmp_path))
    loaded = load_model(str(tmp_path))
    assert isinstance(loaded.model.language_model, PrefixSharedQwen3VLGPTModel)
    batch = grpo_like_samples(248, num_prompts=2, n=3, prompt_len=(5, 12), response_len=(1, 6), seed=2)
    with torch.no_grad():
        shared = make_layout(batch, loaded).to(loaded.device)
        with count_output_rows(loaded.model.language_model) as counts:
            lp = PackedRows.of(shared).logprobs(forward_logits(loaded, shared))
        unshared = make_layout(batch, loaded, share=False).to(loaded.device)
        lp_un = PackedRows.of(unshared).logprobs(forward_logits(loaded, unshared))
    assert counts == [2 + sum(len(s.response) for s in batch)]
    read = read_row_mask(shared)
    assert bool((lp[~read] == 0).all())
    assert float((lp[read] - lp_un[read]).abs().max()) <= 1e-5


# ---- several ranks (gloo): TP + SP, CP, PP -----------------------------------------------------


def expected_rows(cases: str, tp: int, cp: int):
    """Per micro-batch: the read positions (G + sum R) and the packed tokens."""
    out = []
    for mb in MICRO_BATCHES[cases]():
        layout = build_layout(mb, share=True, pad_multiple=tp, total_multiple=2 * tp * cp if cp > 1 else 1)
        out.append((len({tuple(s.prompt) for s in mb}) + sum(len(s.response) for s in mb), layout.num_tokens))
    return out


def check_output_rows(got, cases: str, tp: int, cp: int, prompt_values: bool = False, sp: bool = False):
    expected = expected_rows(cases, tp, cp) * 2  # forward+backward, then forward only
    last = [r for r in got["output_rows"] if r["last_stage"]]
    assert last and all(not r["rows"] for r in got["output_rows"] if not r["last_stage"])
    for t in range(tp):
        per_cp = [r["rows"] for r in last if r["tp"] == t]
        assert len(per_cp) == cp and all(len(rows) == len(expected) for rows in per_cp), per_cp
        for k, (read, tokens) in enumerate(expected):
            total = sum(rows[k] for rows in per_cp)
            if prompt_values:  # megatron's output layer gets the sequence-parallel shard and gathers it
                assert total == tokens // (tp if sp else 1)
            else:
                # each CP rank its shard's read positions; a shard without any runs one row
                assert read <= total <= read + cp - 1 and total < tokens, (k, total, read, tokens)


def test_tp2_sp_runs_read_positions_and_equals_single_rank_unshared(tmp_path, qwen2_checkpoint, unshared_reference):
    got = run_and_compare("outputs_tp2_sp", 2, ["--tp", "2", "--sp"], 2, 1, qwen2_checkpoint[0], unshared_reference, tmp_path)
    check_output_rows(got, "parallel", tp=2, cp=1)


@pytest.mark.slow
def test_tp2_sp_with_prompt_values_runs_every_position(tmp_path, qwen2_checkpoint, unshared_reference):
    got = run_and_compare("outputs_tp2_sp_prompt_values", 2, ["--tp", "2", "--sp", "--prompt-values"], 2, 1,
                          qwen2_checkpoint[0], unshared_reference, tmp_path)
    check_output_rows(got, "parallel", tp=2, cp=1, prompt_values=True, sp=True)


@pytest.mark.slow
def test_pp2_tied_embeddings_runs_read_positions_on_the_last_stage(tmp_path, tied_checkpoint, tied_unshared_reference):
    got = run_and_compare("outputs_pp2_tied", 2, ["--pp", "2"], 1, 2, tied_checkpoint, tied_unshared_reference, tmp_path)
    check_output_rows(got, "parallel", tp=1, cp=1)


@pytest.fixture(scope="module")
def cp_reference(qwen2_loaded):
    return single_rank_unshared(qwen2_loaded, cases="cp")


@pytest.mark.slow
def test_cp2_runs_each_shards_read_positions(tmp_path, qwen2_checkpoint, cp_reference):
    got = run_and_compare("outputs_cp2", 2, ["--cp", "2"], 1, 1, qwen2_checkpoint[0], cp_reference, tmp_path,
                          cp=2, cases="cp")
    check_output_rows(got, "cp", tp=1, cp=2)


@pytest.mark.slow
def test_cp2_tp2_sp_runs_each_shards_read_positions(tmp_path, qwen2_checkpoint, cp_reference):
    got = run_and_compare("outputs_cp2_tp2_sp", 4, ["--cp", "2", "--tp", "2", "--sp"], 2, 1, qwen2_checkpoint[0],
                          cp_reference, tmp_path, cp=2, cases="cp")
    check_output_rows(got, "cp", tp=2, cp=2)
