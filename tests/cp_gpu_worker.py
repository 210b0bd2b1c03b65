"""One rank of tests/test_context_parallel_gpu.py, launched by `torchrun --nproc-per-node 2` on two
GPUs (NCCL): a bf16 model at CP=2, prefix-shared and unshared, and its float32 twin at CP=2 (exactly
the bf16 weights, torch_ref kernels, TF32 off, unshared), through megatron's schedule; global rank 0
saves the relative errors of both bf16 runs against the twin (log-probs and all gradients)."""

import argparse
import json
import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import leave_worker  # noqa: E402


def run(loaded, samples, share, weights):
    from ps_bridge.tools.schedule import logprob_pass

    loaded.model.zero_grad(set_to_none=True)
    [lps] = logprob_pass(loaded, [samples], share=share, loss_weights=[[w.to(loaded.dtype) for w in weights]])
    grads = {n: p.grad.detach().float().clone() for n, p in loaded.model.named_parameters() if p.grad is not None}
    loaded.model.zero_grad(set_to_none=True)
    return torch.cat([lp.double() for lp in lps]), grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-path", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="flash_atten_gpu")
    args = parser.parse_args()

    from transformers import AutoConfig

    from ps_bridge.tools.compare import total_relative_grad_diff
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.parallel.groups import is_output_rank
    from ps_bridge.tools.runtime import float32_reference_model, load_model, tf32_disabled
    from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

    loaded = load_model(args.hf_path, PrefixSharingConfig(backend=args.backend), dtype=torch.bfloat16, cp=2)
    # the GPU test's sizes; a CPU (gloo, a functional check of this worker) gets small ones
    sizes = dict(prompt_len=(150, 400), response_len=(1, 120)) if torch.cuda.is_available() else \
        dict(prompt_len=(20, 40), response_len=(1, 12))
    samples = grpo_like_samples(loaded.vocab_size, num_prompts=3, n=4, **sizes)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s.response), generator=gen) for s in samples]
    twin = float32_reference_model(loaded, AutoConfig.from_pretrained(args.hf_path))
    with tf32_disabled():
        ref_lp, ref_grads = run(twin, samples, False, weights)
    result = {}
    for share in (False, True):
        lp, grads = run(loaded, samples, share, weights)
        result["shared" if share else "unshared"] = dict(
            logprob_rel_err=float((lp - ref_lp).norm() / ref_lp.norm()),
            grad_rel_err=total_relative_grad_diff(grads, ref_grads),
        )
    if is_output_rank():
        with open(args.out, "w") as f:
            json.dump(result, f)
    leave_worker()


if __name__ == "__main__":
    main()
