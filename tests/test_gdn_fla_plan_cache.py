"""The fla backend hands fla the same CPU `cu_seqlens` and chunk index on every layer of a plan
(`ps_bridge.kernels.gdn.fla._per_plan`): fla memoizes its varlen helpers by argument identity."""

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
    # a bounded cache: old plans are dropped
    for _ in range(backend._PER_PLAN_SIZE + 1):
        t = torch.tensor(host)
        backend._per_plan(t, host, chunk_index=False)
    assert len(backend._PER_PLAN) == backend._PER_PLAN_SIZE
