"""Context parallelism on two GPUs (NCCL, marker `gpu`): a prefix-shared bf16 run at CP=2 must be
about as close to a float32 twin (the same bf16 weights, torch_ref kernels, TF32 off, unshared, also
at CP=2) as the unshared bf16 run at CP=2 is, for log-probs and all gradients; the same criterion as
tests/test_bf16_vs_fp32_gpu.py at CP=1.

Run on two H200s:  python -m pytest -q -s -m gpu tests/test_context_parallel_gpu.py
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import torchrun  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

WORSE_THAN_UNSHARED = 1.5  # as tests/test_bf16_vs_fp32_gpu.py
WORKER = os.path.join(os.path.dirname(__file__), "cp_gpu_worker.py")


def test_qwen2_cp2_bf16_shared_is_as_close_to_fp32_as_unshared(tmp_path):
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2

    # head dim 128, 4 query heads (2 per CP rank), 1 KV head: repeated for CP
    build_tiny_qwen2(str(tmp_path / "ckpt"), vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024)
    out = tmp_path / "errors.json"
    proc = torchrun(2, [WORKER, "--hf-path", str(tmp_path / "ckpt"), "--out", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    print(f"\n[qwen2.5 CP=2 bf16 vs fp32] log-prob rel err shared {r['shared']['logprob_rel_err']:.3e} / unshared "
          f"{r['unshared']['logprob_rel_err']:.3e}; gradient rel err shared {r['shared']['grad_rel_err']:.3e} / "
          f"unshared {r['unshared']['grad_rel_err']:.3e}")
    assert r["unshared"]["logprob_rel_err"] < 2e-2 and r["unshared"]["grad_rel_err"] < 5e-2  # bf16 itself is sane
    for key in ("logprob_rel_err", "grad_rel_err"):
        assert r["shared"][key] <= WORSE_THAN_UNSHARED * r["unshared"][key] + 1e-6
