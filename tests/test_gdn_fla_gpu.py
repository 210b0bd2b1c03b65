"""fla backend vs torch_ref on a GPU: outputs and gradients of the forked GDN (bf16 and fp32 inputs).

Run on an H200:  python -m pytest -q -m gpu tests/test_gdn_fla_gpu.py
Skipped without CUDA. The fla GDN backward on Hopper needs Triton >= 3.7.1 or tilelang; the
backward test fails with the project's own message otherwise (that message is checked too).
"""

import pytest
import torch

from gdn_cases import make_case, packed_inputs
from ps_bridge.kernels.gdn import (
    check_gdn_backend_usable,
    plan_from_layout,
    prefix_shared_gated_delta_net,
    resolve_gdn_backend,
)
from ps_bridge.kernels.gdn.fla_backend import hopper_backward_problem
from ps_bridge.layout import build_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# fla's chunked kernels accumulate in fp32 but round inputs/outputs to the input dtype
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 5e-2}


def run(case, layout, backend, dtype, device):
    leaves = [t.detach().to(device=device, dtype=dtype).requires_grad_(True) for t in case.leaves()]
    it = iter(leaves[2:])
    conv_w, conv_b = leaves[0], leaves[1]
    # re-point the case at the device copies so packed_inputs assembles from them
    prompt_leaves = [tuple(next(it) for _ in range(3)) for _ in case.prompt_leaves]
    response_leaves = [tuple(next(it) for _ in range(3)) for _ in case.response_leaves]
    dev_case = type(case)(**{**case.__dict__, "prompt_leaves": prompt_leaves, "response_leaves": response_leaves,
                             "conv_weight": conv_w, "conv_bias": conv_b})
    mixed, g, beta = packed_inputs(dev_case, layout, pad_value=0.0)
    g = g.float()  # the model computes the log decay in fp32
    out = prefix_shared_gated_delta_net(
        mixed, g, beta, conv_w, conv_b, plan_from_layout(layout, device), backend,
        num_key_heads=case.num_key_heads, key_head_dim=case.key_head_dim, value_head_dim=case.value_head_dim)
    weight = torch.randn(out.shape, generator=torch.Generator(device=device).manual_seed(0), device=device)
    loss = (out.float() * weight).sum()
    grads = torch.autograd.grad(loss, leaves)
    return out.float(), [g_.float() for g_ in grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_matches_torch_ref(dtype):
    device = torch.device("cuda")
    problem = hopper_backward_problem(device)
    if problem:
        with pytest.raises(RuntimeError, match="Triton >= 3.7.1.*tilelang|tilelang"):
            check_gdn_backend_usable("fla", device)
        pytest.skip(problem)
    # head dims the Triton kernels like; several groups, uneven lengths, padding
    case = make_case(seed=1, group_sizes=(4, 1, 3), prompt_lens=(70, 5, 129),
                     response_lens=[33, 1, 64, 90, 7, 12, 65, 3], dtype=torch.float32, H=2, K=64, HV=4, V=64)
    layout = build_layout(case.samples, share=True, pad_multiple=8)
    out_ref, g_ref = run(case, layout, resolve_gdn_backend("torch_ref", device), dtype, device)
    out_fla, g_fla = run(case, layout, resolve_gdn_backend("fla", device), dtype, device)
    tol = TOLERANCE[dtype]
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()
    assert rel(out_fla, out_ref) < tol, rel(out_fla, out_ref)
    for a, b in zip(g_fla, g_ref):
        assert rel(a, b) < tol, rel(a, b)
