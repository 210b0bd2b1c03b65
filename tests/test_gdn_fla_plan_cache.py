"""The fla backend hands fla the same CPU `cu_seqlens` and chunk index on every layer of a plan, for as
long as the plan lives (`ps_bridge.kernels.gdn.fla._per_plan`)."""

import gc

import pytest
import torch

pytest.importorskip("fla")


def test_per_plan_objects_are_made_once_and_equal_flas_own():
    from fla.ops.utils.index import prepare_chunk_indices

    from ps_bridge.kernels.gdn import fla as backend

    host = [0, 5, 70, 71, 200]
    cu = torch.tensor(host)
    cpu, index = backend._per_plan(cu, host, chunk_index=True)
    again = backend._per_plan(cu, host, chunk_index=True)
    assert again[0] is cpu and again[1] is index
    assert cpu.tolist() == host
    assert torch.equal(index, prepare_chunk_indices(cu, backend.CHUNK_SIZE))
    # another plan's tensor (even with equal values) gets its own entry
    other = torch.tensor(host)
    assert backend._per_plan(other, host, chunk_index=False)[0] is not cpu
    # an entry lives as long as its plan's tensor, however many plans come after it (a CUDA graph
    # captured on the plan reads its chunk index at every replay), and goes with it
    for _ in range(64):
        backend._per_plan(torch.tensor(host), host, chunk_index=True)
    assert backend._per_plan(cu, host, chunk_index=True)[1] is index
    entries = len(backend._PER_PLAN)
    del other
    gc.collect()
    assert len(backend._PER_PLAN) == entries - 1
