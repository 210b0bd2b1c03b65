"""verl's packed mRoPE position ids when all samples have one length (`ps_bridge.compat.verl_position_ids`):
torch then makes the 4 rows the ragged dimension, verl's workers declare the length ragged, and the next
index of the batch fails; rebuilt, every sample reads back its own `[4, length]` ids."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

from ps_bridge.compat.verl_on_cpu import install_absent_module_placeholders  # noqa: E402

install_absent_module_placeholders()  # verl's own imports of what `make test`'s stacks leave out (ray)
from verl.utils import tensordict_utils  # noqa: E402

if not hasattr(tensordict_utils, "maybe_fix_3d_position_ids"):
    pytest.skip("this verl packs no 3D position ids (verl 0.8.0)", allow_module_level=True)

from tensordict import TensorDict  # noqa: E402

from ps_bridge.compat import verl_position_ids  # noqa: E402


def _batch(lengths):
    ids = [torch.arange(4 * n).reshape(4, n) + 100 * i for i, n in enumerate(lengths)]
    position_ids = torch.nested.as_nested_tensor(ids, layout=torch.jagged)  # as verl/workers/utils/padding.py:67
    input_ids = torch.nested.as_nested_tensor([torch.zeros(n, dtype=torch.long) for n in lengths], layout=torch.jagged)
    return ids, TensorDict({"position_ids": position_ids, "input_ids": input_ids}, batch_size=len(lengths))


def test_equal_lengths_fail_in_verl_as_is():
    ids, td = _batch([5, 5, 5])
    assert td["position_ids"].offsets().tolist() == [0, 4, 8, 12]  # torch took the 4 rows as ragged
    stock = getattr(tensordict_utils.maybe_fix_3d_position_ids, "__wrapped__", tensordict_utils.maybe_fix_3d_position_ids)
    stock(td)
    with pytest.raises(RuntimeError):  # torch 2.11: "split_with_sizes expects ...", 2.14: "Expected cond to be True"
        tensordict_utils.index_select_tensor_dict(td, [2, 0])


@pytest.mark.parametrize("lengths", [[5, 5, 5], [3, 7, 2], [4], [6]])
def test_rebuilt_ids_index_like_verls_own(lengths):
    assert verl_position_ids.install()
    ids, td = _batch(lengths)
    tensordict_utils.maybe_fix_3d_position_ids(td)
    pos = td["position_ids"]
    assert pos.offsets().tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    for got, want in zip(pos.unbind(), ids):
        assert torch.equal(got, want)
    picked = list(range(len(lengths)))[::-1]
    selected = tensordict_utils.index_select_tensor_dict(td, picked)
    for got, i in zip(selected["position_ids"].unbind(), picked):
        assert torch.equal(got, ids[i])


def test_other_tensors_are_left_alone():
    flat = torch.nested.as_nested_tensor([torch.zeros(3), torch.zeros(5)], layout=torch.jagged)
    assert verl_position_ids.rebuilt_position_ids(flat) is flat
    unequal = torch.nested.as_nested_tensor([torch.zeros(4, 3), torch.zeros(4, 5)], layout=torch.jagged)
    assert verl_position_ids.rebuilt_position_ids(unequal) is unequal
    dense = torch.zeros(2, 4, 5)
    assert verl_position_ids.rebuilt_position_ids(dense) is dense
