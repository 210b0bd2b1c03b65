"""TP+SP and PP on two NVIDIA GPUs with NCCL (marker `gpu`; skipped without two CUDA devices).

The same torchrun worker and checks as the CPU tests; the reference is the single-GPU unshared run
of this process. fp32 with TF32 off on both sides, so the tolerance stays near the CPU one.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import (  # noqa: E402
    WORKER,
    check_rank_logs,
    max_logprob_diff,
    relative_grad_diffs,
    torchrun,
    unshared_reference,  # noqa: F401 (fixture)
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

GPU_CONFIGS = {
    "tp2_sp": (["--tp", "2", "--sp"], 2, 1),
    "pp2": (["--pp", "2"], 1, 2),
}


@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_two_gpu_nccl_run_equals_single_gpu_unshared(name, tmp_path, qwen2_checkpoint, unshared_reference):
    assert not torch.backends.cuda.matmul.allow_tf32  # the reference must be true fp32
    flags, tp, pp = GPU_CONFIGS[name]
    out = tmp_path / "result.pt"
    proc = torchrun(2, [WORKER, "--hf-path", qwen2_checkpoint[0], "--out", str(out), *flags])
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    logprob_diff = max_logprob_diff(got["logprobs"], unshared_reference["logprobs"])
    grad_diff = max(relative_grad_diffs(got["grads"], unshared_reference["grads"]).values())
    print(f"{name}: max |logp| diff {logprob_diff:.2e}, max relative grad diff {grad_diff:.2e}")
    assert logprob_diff <= 2e-5
    assert max_logprob_diff(got["forward_only"], unshared_reference["logprobs"]) <= 2e-5
    assert grad_diff <= 2e-5
    check_rank_logs(proc.stderr, tp, pp)
    for rank in (0, 1):
        assert f"[parallel_worker] global_rank={rank} backend=nccl device=cuda:{rank}" in proc.stderr
