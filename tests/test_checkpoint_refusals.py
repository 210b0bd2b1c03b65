"""Loads that cannot give back the saved values are refused, naming the setting and the fix
(docs/checkpoints.md): the distributed optimizer's `dp_reshardable` state at another parallel layout or
parameter order, checked against the layout record our engine's save writes (`ps_bridge.checkpoint`); the
end-to-end runs are in tests/test_checkpoint_resume.py / test_checkpoint_parallel.py (slow)."""

import json

import pytest
import torch

from ps_bridge.checkpoint import (LAYOUT_RECORD, InexactLoadError, buffer_order, refuse_dp_reshardable_change,
                                  write_layout_record)

pytestmark = pytest.mark.core  # no verl: both stacks (passes on the oldest: megatron-core 0.18.0)


class _Buffer:
    """What the check reads of megatron's DDP buffer: where each parameter lies."""

    def __init__(self, params):
        self.param_dtype = torch.float32
        self.param_index_map, start = {}, 0
        for p in params:
            self.param_index_map[p] = (start, start + p.numel(), 0)
            start += p.numel()


class _Chunk(torch.nn.Module):
    """A model chunk as megatron's DDP wraps it: parameters, and buffers in one order of them."""

    def __init__(self, order):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
        self.buffers = [_Buffer([getattr(self, n) for n in order])]
        self.expert_parallel_buffers = []


@pytest.fixture
def saved(tmp_path):
    from ps_bridge.parallel.groups import init_parallel

    init_parallel()
    write_layout_record(str(tmp_path), [_Chunk("ab")])
    return tmp_path


def test_dp_reshardable_state_loads_only_at_the_saved_layout_and_order(saved):
    refuse_dp_reshardable_change(str(saved), [_Chunk("ab")], "dp_reshardable")  # the same: loads
    assert buffer_order([_Chunk("ab")]) != buffer_order([_Chunk("ba")])
    with pytest.raises(InexactLoadError, match="another order.*dist_ckpt_optim_fully_reshardable=True"):
        refuse_dp_reshardable_change(str(saved), [_Chunk("ba")], "dp_reshardable")
    with pytest.raises(InexactLoadError, match=r"vpp 1 -> 2.*dist_ckpt_optim_fully_reshardable=True"):
        refuse_dp_reshardable_change(str(saved), [_Chunk("ab"), _Chunk("ab")], "dp_reshardable")
    record = saved / "optimizer" / LAYOUT_RECORD
    layout = json.loads(record.read_text())
    layout["layout"]["tp"] = 2
    record.write_text(json.dumps(layout))
    with pytest.raises(InexactLoadError, match=r"tp 2 -> 1"):
        refuse_dp_reshardable_change(str(saved), [_Chunk("ab")], "dp_reshardable")
    # the formats that reshard, and the non-distributed optimizer, are not checked
    for sharding_type in ("fully_reshardable", "fully_sharded_model_space", None):
        refuse_dp_reshardable_change(str(saved), [_Chunk("ba")], sharding_type)
    record.unlink()  # a checkpoint of the stock engine: nothing to check the state against
    with pytest.raises(InexactLoadError, match=f"no {LAYOUT_RECORD}.*dist_ckpt_optim_fully_reshardable=True"):
        refuse_dp_reshardable_change(str(saved), [_Chunk("ab")], "dp_reshardable")


def test_mtp_weights_on_one_side_only_are_refused(tmp_path):
    """Prefix sharing never builds the multi-token-prediction layer: a checkpoint with `mtp.*` weights
    (the stock Qwen3.5 provider's) is refused by our engine's load, naming mtp_num_layers; one without loads."""
    import torch.distributed.checkpoint as dcp

    from ps_bridge.checkpoint import refuse_mtp_mismatch

    with_mtp, without = str(tmp_path / "with_mtp"), str(tmp_path / "without")
    dcp.save({"decoder.final_layernorm.weight": torch.ones(2), "mtp.layers.0.enorm.weight": torch.ones(2)},
             checkpoint_id=with_mtp)
    dcp.save({"decoder.final_layernorm.weight": torch.ones(2)}, checkpoint_id=without)
    with pytest.raises(InexactLoadError, match="mtp_num_layers"):
        refuse_mtp_mismatch([with_mtp], model_has_mtp=False)
    refuse_mtp_mismatch([without], model_has_mtp=False)
    refuse_mtp_mismatch([with_mtp], model_has_mtp=True)
    with pytest.raises(InexactLoadError, match="mtp_num_layers"):
        refuse_mtp_mismatch([without], model_has_mtp=True)
