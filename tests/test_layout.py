"""The packed layout: grouping, positions, padding, inverse map, verl's padded form, bad input."""

import logging

import pytest
import torch

from ps_bridge.layout import Sample, build_layout, find_groups, samples_from_padded


def _row_tokens(layout, i):
    a, b = int(layout.row_offsets[i]), int(layout.row_offsets[i + 1])
    return layout.tokens[layout.row_source[a:b]].tolist()


def _row_positions(layout, i):
    a, b = int(layout.row_offsets[i]), int(layout.row_offsets[i + 1])
    return layout.positions[layout.row_source[a:b]].tolist()


def check_inverse_map(layout, samples):
    """Every sample's row reads back its own sequence, at positions 0..L-1, with shifted labels."""
    for i, s in enumerate(samples):
        seq = list(s.prompt) + list(s.response)
        assert _row_tokens(layout, i) == seq
        assert _row_positions(layout, i) == list(range(len(seq)))
        a, b = int(layout.row_offsets[i]), int(layout.row_offsets[i + 1])
        assert layout.row_label[a:b].tolist() == seq[1:] + [-1]
        assert layout.valid[layout.row_source[a:b]].all()


def test_groups_by_identical_prompt_tokens_in_any_order():
    samples = [Sample([1, 2, 3], [4]), Sample([9, 9], [1, 2]), Sample([1, 2, 3], [5, 6]), Sample([9, 9], [3])]
    assert find_groups(samples) == [[0, 2], [1, 3]]
    layout = build_layout(samples)
    assert layout.num_groups == 2 and layout.has_sharing
    # prompt block first, then responses group by group
    assert layout.host["valid_lengths"] == [3, 2, 1, 2, 2, 1]
    assert layout.host["segment_is_prompt"] == [True, True, False, False, False, False]
    assert layout.host["segment_group"] == [0, 1, 0, 0, 1, 1]
    assert layout.tokens_unshared == 4 + 4 + 5 + 3 and layout.tokens_shared == 11
    check_inverse_map(layout, samples)


def test_uid_never_decides_grouping():
    samples = [Sample([1, 2], [3], uid="a"), Sample([1, 5], [3], uid="a"), Sample([1, 2], [4], uid="b")]
    assert find_groups(samples) == [[0, 2], [1]]


def test_response_positions_continue_after_prompt():
    layout = build_layout([Sample([7, 8, 9, 10], [1, 2, 3]), Sample([7, 8, 9, 10], [4])])
    resp = layout.positions[~layout.is_prompt & layout.valid].tolist()
    assert resp == [4, 5, 6, 4]


def test_padding_per_sequence_to_tp_multiple():
    layout = build_layout([Sample([1, 2, 3, 4, 5], [6, 7])], pad_multiple=2)
    assert layout.host["valid_lengths"] == [5, 2]
    assert layout.host["padded_lengths"] == [6, 2]
    assert layout.cu_seqlens_padded.tolist() == [0, 6, 8]
    assert layout.cu_seqlens.tolist() == [0, 5, 7]
    assert layout.num_tokens == 8 and int(layout.valid.sum()) == 7
    check_inverse_map(layout, [Sample([1, 2, 3, 4, 5], [6, 7])])


def test_no_sharing_logs_path5_and_sharing_logs_path6(caplog):
    from ps_bridge.layout import log_layout

    with caplog.at_level(logging.INFO, logger="ps_bridge"):
        log_layout(build_layout([Sample([1], [2]), Sample([3], [4])]))
        log_layout(build_layout([Sample([1], [2]), Sample([1], [4])]))
    text = caplog.text
    assert "[PS][prepare] PATH 5: no sharing detected" in text
    assert "[PS][prepare] PATH 6: sharing detected" in text
    assert "packed_batch_layout: valid_lengths=" in text


@pytest.mark.parametrize(
    "samples",
    [
        [Sample([5], [6]), Sample([5], [7, 8])],  # one-token prompt
        [Sample([1, 2, 3], [4]), Sample([1, 2, 3], [4])],  # identical one-token responses
        [Sample([1, 2, 3], [4, 5])],  # a group of one
        [Sample([1, 2], [3]), Sample([4, 5], [6]), Sample([7], [8])],  # no sharing at all
    ],
)
def test_edge_cases_round_trip(samples):
    for share in (True, False):
        for pad in (1, 2, 4):
            layout = build_layout(samples, share=share, pad_multiple=pad)
            check_inverse_map(layout, samples)
            assert all(n % pad == 0 for n in layout.host["padded_lengths"])


def test_unshared_layout_is_one_segment_per_sample():
    samples = [Sample([1, 2], [3]), Sample([1, 2], [4, 5])]
    layout = build_layout(samples, share=False)
    assert layout.host["valid_lengths"] == [3, 4]
    assert not layout.has_sharing and layout.num_groups == 2
    check_inverse_map(layout, samples)


def test_last_prompt_position_is_shared_with_per_response_labels():
    samples = [Sample([1, 2, 3], [4, 5]), Sample([1, 2, 3], [6])]
    layout = build_layout(samples)
    # row position P-1 = 2 of both samples reads the same packed position with different labels
    src0, src1 = layout.row_source[2], layout.row_source[int(layout.row_offsets[1]) + 2]
    assert src0 == src1
    assert layout.row_label[2] == 4 and layout.row_label[int(layout.row_offsets[1]) + 2] == 6


@pytest.mark.parametrize(
    "samples, message",
    [
        ([], "empty"),
        ([Sample([], [1])], "prompt is empty"),
        ([Sample([1], [])], "response is empty"),
        ([Sample([1, 300], [2])], "out of the vocabulary"),
        ([Sample([1], [-2])], "out of the vocabulary"),
    ],
)
def test_bad_input_fails_clearly(samples, message):
    with pytest.raises(ValueError, match=message):
        build_layout(samples, vocab_size=256)


def test_verl_padded_form():
    # left-padded prompts, right-padded responses
    prompts = torch.tensor([[0, 0, 1, 2], [0, 0, 1, 2], [3, 4, 5, 6]])
    responses = torch.tensor([[7, 8, 0], [9, 0, 0], [1, 1, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    samples = samples_from_padded(prompts, responses, mask, uids=["u0", "u0", "u1"])
    assert [(s.prompt, s.response) for s in samples] == [([1, 2], [7, 8]), ([1, 2], [9]), ([3, 4, 5, 6], [1, 1, 1])]
    layout = build_layout(samples)
    assert layout.num_groups == 2
    bad = mask.clone()
    bad[0, 3] = 0  # a hole inside the prompt: [0, 0, 1, 0]
    with pytest.raises(ValueError, match="left-padded"):
        samples_from_padded(prompts, responses, bad)


def test_group_split_across_micro_batches_still_packs_each_part():
    samples = [Sample([1, 2, 3], [4]), Sample([1, 2, 3], [5]), Sample([1, 2, 3], [6])]
    first, second = build_layout(samples[:2]), build_layout(samples[2:])
    assert first.has_sharing and not second.has_sharing
    check_inverse_map(first, samples[:2])
    check_inverse_map(second, samples[2:])
