"""Expert parallelism (EP) with prefix sharing on CPU (gloo): EP ranks are data-parallel ranks, so
whole prompt groups are split across them (`ps_bridge.data_parallel`) and the rows gathered on rank
0; the experts exchange tokens through megatron's allgather dispatcher (each rank holds half of the
experts). `torchrun --nproc-per-node 2 -m ps_bridge.cli logprobs ... --ep 2` equals Hugging Face's
log-probs on a Qwen3.5 MoE checkpoint, with and without sharing."""

import json
import os
import sys

import pytest
import torch

from ps_bridge.data_parallel import split_groups
from ps_bridge.layout import Sample
from ps_bridge.parallel import ParallelSettings
from ps_bridge.tiny_checkpoints import grpo_like_samples, hf_sample_logprobs

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import torchrun  # noqa: E402


def test_split_groups_keeps_groups_whole_and_balances_tokens():
    samples = grpo_like_samples(200, num_prompts=5, n=3, prompt_len=(5, 13), response_len=(1, 7), seed=0)
    shares = split_groups(samples, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(samples)))
    for share in shares:
        prompts = {tuple(samples[i].prompt) for i in share}
        other = {tuple(samples[i].prompt) for s in shares if s is not share for i in s}
        assert share and not prompts & other  # whole groups, each on one rank
    with pytest.raises(ValueError, match="prompt group"):
        split_groups([Sample([1, 2], [3]), Sample([1, 2], [4])], 2)


def test_world_that_cannot_hold_ep_is_refused():
    ParallelSettings(ep=2).check(world_size=2)
    ParallelSettings(ep=2, tp=2, sequence_parallel=True).check(world_size=4)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2"):
        ParallelSettings(ep=2).check(world_size=1)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2"):
        ParallelSettings(ep=2, tp=2).check(world_size=2)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from ps_bridge.tiny_checkpoints import build_tiny_qwen35_moe

    path = str(tmp_path_factory.mktemp("qwen35_moe_ep"))
    build_tiny_qwen35_moe(path)
    samples = grpo_like_samples(248, num_prompts=3, n=3, prompt_len=(5, 13), response_len=(1, 7), seed=0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, samples, hf_sample_logprobs(hf, samples)


@pytest.mark.parametrize("share", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_cli_ep2_equals_hf(moe_checkpoint, tmp_path, share):
    path, samples, reference = moe_checkpoint
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    out = tmp_path / "out.json"
    argv = ["-m", "ps_bridge.cli", "logprobs", "--hf-path", path, "--batch", str(batch), "--out", str(out), "--ep", "2"]
    proc = torchrun(2, argv + ([] if share else ["--no-prefix-sharing"]), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["samples"]
    assert len(rows) == len(samples)
    worst = max((torch.tensor(r["logprobs"]) - ref.float()).abs().max().item() for r, ref in zip(rows, reference))
    assert worst <= 2e-5, worst


# ep2_cp2: 4 ranks, data parallel size 2 with CP=2; megatron forms the expert-parallel groups out of the
# data-parallel-with-CP ranks, so here the two CP ranks of a data-parallel rank hold different experts
EP_CASES = {"ep2": (2, ["--ep", "2"]), "ep2_tp2_sp": (4, ["--ep", "2", "--tp", "2", "--sp"]),
            "ep2_cp2": (4, ["--ep", "2", "--cp", "2"])}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) for c in EP_CASES])
def test_ep_logprobs_and_gradients_equal_single_rank_unshared(moe_checkpoint, tmp_path, case):
    """Log-probs and every HF-named gradient (aux loss included: the model trains) of the
    prefix-shared EP run, groups split across the data-parallel ranks and gradients summed over
    them (`data_parallel.reduce_data_parallel_gradients`: the loss is a plain sum over samples),
    equal the single-rank unshared run on the whole batch. Under EP x CP the expert weights' gradients
    are reduced over the expert-data-parallel group, not the data-parallel-with-CP one (whose CP ranks
    hold other experts: `parallel.finish_gradients`)."""
    from parallel_cases import WORKER, ep_micro_batches, max_logprob_diff, micro_batch_weights, relative_grad_diffs

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.parallel import hf_named_gradients
    from ps_bridge.runtime import load_model
    from ps_bridge.schedule import logprob_pass

    path, _, _ = moe_checkpoint
    loaded = load_model(path, PrefixSharingConfig(enabled=True))
    micro_batches = ep_micro_batches()
    loaded.model.zero_grad(set_to_none=True)
    ref_logprobs = logprob_pass(loaded, micro_batches, share=False, loss_weights=micro_batch_weights(micro_batches))
    ref_grads = hf_named_gradients(loaded.bridge, loaded.model)
    nproc, flags = EP_CASES[case]
    out = tmp_path / "result.pt"
    proc = torchrun(nproc, [WORKER, "--hf-path", path, "--out", str(out), *flags], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    assert max_logprob_diff(got["logprobs"], ref_logprobs) <= 1e-5
    assert max_logprob_diff(got["forward_only"], ref_logprobs) <= 1e-5
    diffs = relative_grad_diffs(got["grads"], ref_grads)
    wrong = {n: f"{d:.2e}" for n, d in diffs.items() if not d <= 1e-5}
    assert not wrong, wrong
