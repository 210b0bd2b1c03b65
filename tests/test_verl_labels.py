"""The verl engine's row labels (`ps_bridge.verl.engine.thd_row_labels`) equal what verl's own
`preprocess_thd_engine(need_roll=True)` gives at CP=1, row by row, for random batches and TP sizes:
each row's last position reads the next row's first token or padding, as verl's roll leaves it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

import ps_bridge.tools.verl_check.side_by_side as vt  # noqa: E402

vt.prepare_side_by_side()

from megatron.core import parallel_state as mpu  # noqa: E402

from ps_bridge.compat import verl as verl_compat  # noqa: E402
from ps_bridge.verl.engine import thd_row_labels  # noqa: E402


def verl_row_labels(labels) -> torch.Tensor:
    rolled, params = verl_compat.roll_thd_labels(labels, False, None)
    starts = params.cu_seqlens_q_padded.tolist()
    return torch.cat([rolled[0, s : s + n] for s, n in zip(starts, labels.offsets().diff().tolist())])


@pytest.mark.core
@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(6))
def test_row_labels_equal_verls_roll(monkeypatch, tp, seed, offsets_dtype):
    """verl's batches reach the engine with int64 or int32 nested offsets (its index selections keep
    either): both give verl's labels."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, 1000, (int(n),), generator=g) for n in torch.randint(1, 40, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g)]
    lengths = torch.tensor([len(r) for r in rows])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(offsets_dtype)
    labels = torch.nested.nested_tensor_from_jagged(torch.cat(rows), offsets)
    assert labels.offsets().dtype == offsets_dtype
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_world_size", lambda *a, **k: tp)
    monkeypatch.setattr(mpu, "get_context_parallel_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(mpu, "get_context_parallel_rank", lambda *a, **k: 0)
    want = verl_row_labels(labels)
    got = thd_row_labels(labels, tp)
    assert got.dtype == want.dtype and torch.equal(got, want)
