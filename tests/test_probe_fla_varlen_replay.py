"""tools/probe_fla_varlen_replay.py's bookkeeping, on the CPU: the filler sequences pad any batch within
the token budget to one sequence count and one 64-token chunk count (what a CUDA graph of fla's varlen
kernels needs to replay it), and the probe's dry run (torch_ref's kernels in place of fla's, the step
rerun in place of a graph) finds the padded batch's real part equal to the real sequences alone, and a
misplaced real part different."""

import importlib.util
import pathlib

import pytest
import torch

from ps_bridge.kernels.gdn import torch_ref

SPEC = importlib.util.spec_from_file_location(
    "probe_fla_varlen_replay", pathlib.Path(__file__).resolve().parents[1] / "tools" / "probe_fla_varlen_replay.py")
probe = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(probe)


@pytest.mark.parametrize("tokens,sequences", [(2048, 8), (512, 8), (4096, 64), (8192, 130)])
def test_fillers_give_every_batch_one_shape(tokens, sequences):
    out = probe.host_check(tokens, sequences, trials=3000)
    count, chunk_count = probe.fixed_shape(tokens, sequences)
    assert out["padded_sequences"] == count and out["chunks"] == chunk_count


def test_fewer_fillers_do_not_always_do():
    saved = probe.fixed_shape
    probe.fixed_shape = lambda t, s: (2 * s, probe.chunks(t) + s)  # as many fillers as real sequences
    try:
        with pytest.raises(ValueError, match="fillers hold"):
            probe.host_check(2048, 8, trials=3000)
    finally:
        probe.fixed_shape = saved


def _kernels():
    def conv(x, weight, bias, initial_state, activation, cu_seqlens, chunk_indices, **kw):
        assert chunk_indices.tolist() == probe.chunk_index(torch.diff(cu_seqlens).tolist())
        y, _ = torch_ref.causal_conv1d(x.squeeze(0), weight, bias, cu_seqlens, cu_seqlens.tolist(), initial_state,
                                       False, activation)
        return y.unsqueeze(0), None

    def rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices, **kw):
        assert chunk_indices.tolist() == probe.chunk_index(torch.diff(cu_seqlens).tolist())
        o, ht = torch_ref.gated_delta_rule(q[0].float(), k[0].float(), v[0].float(), g[0], beta[0].float(), scale,
                                           cu_seqlens, cu_seqlens.tolist(), initial_state, True)
        return o.to(q.dtype).unsqueeze(0), ht

    return conv, rule


def test_dry_run_compares_the_real_part_with_the_sequences_alone(monkeypatch):
    out = probe.run_gpu(256, 4, 2, 16, 4, device="cpu", kernels=_kernels())
    assert len(out["batches"]) == 4 and len({tuple(b["lengths"]) for b in out["batches"]}) == 4
    for b in out["batches"]:
        assert b["replay_equals_eager_padded"]
        assert max(b["rel_err_replay_vs_alone"].values()) < 1e-6
    # fillers placed before the real sequences: the real part the probe reads is then the fillers', caught
    padded_batch = probe.padded_batch
    monkeypatch.setattr(probe, "padded_batch", lambda lengths, tokens, sequences: (
        lambda full: full[len(lengths):] + full[:len(lengths)])(padded_batch(lengths, tokens, sequences)))
    wrong = probe.run_gpu(256, 4, 2, 16, 4, device="cpu", kernels=_kernels())
    assert all(max(b["rel_err_replay_vs_alone"].values()) > 0.1 for b in wrong["batches"])
