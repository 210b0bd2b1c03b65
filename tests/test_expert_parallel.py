"""Expert parallelism (EP) with prefix sharing on CPU (gloo): EP ranks are data-parallel ranks, so
whole prompt groups are split across them (`ps_bridge.tools.data_parallel`) and the rows gathered on rank
0; the experts exchange tokens through megatron's allgather dispatcher (each rank holds half of the
experts). `torchrun --nproc-per-node 2 -m ps_bridge.tools.cli logprobs ... --ep 2` equals Hugging Face's
log-probs on a Qwen3.5 MoE checkpoint, with and without sharing."""

import json
import os
import sys

import pytest
import torch

from ps_bridge.tools.data_parallel import split_groups
from ps_bridge.layout import Sample
from ps_bridge.parallel.settings import ParallelSettings
from ps_bridge.tools.tiny_checkpoints import grpo_like_samples, hf_sample_logprobs

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


def _checkpoint_and_hf_logprobs(tmp_path_factory, family):
    """A tiny `family` checkpoint, a GRPO-like batch (ids below the tiny vocabularies' special ids) and HF's log-probs."""
    from transformers import AutoModelForCausalLM

    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    path = str(tmp_path_factory.mktemp(family.replace(".", "_") + "_ep"))
    TINY_BUILDERS[family](path)
    samples = grpo_like_samples(248, num_prompts=3, n=3, prompt_len=(5, 13), response_len=(1, 7), seed=0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, samples, hf_sample_logprobs(hf, samples)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return _checkpoint_and_hf_logprobs(tmp_path_factory, "qwen3.5-moe")


@pytest.fixture(scope="module")
def qwen3_moe_checkpoint(tmp_path_factory):
    """Qwen3 MoE (no shared expert, a dense layer among the MoE layers, norm_topk_prob)."""
    return _checkpoint_and_hf_logprobs(tmp_path_factory, "qwen3-moe")


@pytest.mark.parametrize("checkpoint, share", [
    ("moe_checkpoint", True), pytest.param("moe_checkpoint", False, marks=pytest.mark.slow),
    pytest.param("qwen3_moe_checkpoint", True, marks=pytest.mark.slow),
])
def test_cli_ep2_equals_hf(checkpoint, tmp_path, share, request):
    path, samples, reference = request.getfixturevalue(checkpoint)
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    out = tmp_path / "out.json"
    argv = ["-m", "ps_bridge.tools.cli", "logprobs", "--hf-path", path, "--batch", str(batch), "--out", str(out), "--ep", "2"]
    proc = torchrun(2, argv + ([] if share else ["--no-prefix-sharing"]), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["samples"]
    assert len(rows) == len(samples)
    worst = max((torch.tensor(r["logprobs"]) - ref.float()).abs().max().item() for r, ref in zip(rows, reference))
    assert worst <= 2e-5, worst


# checkpoint fixture -> its MoE layers (Qwen3 MoE's tiny checkpoint has a dense layer among four)
MOE_LAYERS = {"moe_checkpoint": 4, "qwen3_moe_checkpoint": 3}


EP_CASES = {
    "ep2": (2, ["--ep", "2"]),
    "ep2_tp2_sp": (4, ["--ep", "2", "--tp", "2", "--sp"]),
    "ep2_pp2": (4, ["--ep", "2", "--pp", "2"]),
    # megatron's MoE recompute under 1F1B: stage 0 runs micro-batch 1's forward before micro-batch 0's
    # backward, where the MoE layer is recomputed with micro-batch 0's own token weights
    "ep2_pp2_moe_recompute": (4, ["--ep", "2", "--pp", "2", "--moe-recompute"]),
    # 4 ranks, data parallel size 2 with CP=2; megatron forms the expert-parallel groups out of the
    # data-parallel-with-CP ranks, so here the two CP ranks of a data-parallel rank hold different experts
    "ep2_cp2": (4, ["--ep", "2", "--cp", "2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint, case", [("moe_checkpoint", c) for c in sorted(EP_CASES)]
                         + [("qwen3_moe_checkpoint", c) for c in ("ep2", "ep2_tp2_sp", "ep2_cp2")])
def test_ep_logprobs_and_gradients_equal_single_rank_unshared(checkpoint, tmp_path, case, request):
    """Log-probs, every HF-named gradient and the load-balancing loss (the model trains) of the
    prefix-shared EP run, groups split across the data-parallel ranks and gradients summed over
    them (`parallel.finish_gradients`: the loss is a plain sum over samples, so
    the sum, not megatron's DDP mean, is the whole batch's gradient; expert weights are summed over
    the expert data-parallel group), equal the single-rank unshared run on the whole batch. Under
    PP=2 every stage holds two of the four layers and its EP ranks exchange tokens among themselves.
    The aux loss: each rank's value is its share, the shares of all ranks add up to the single-rank one
    ("global_aux_loss"); where megatron's statistic is rank-local ("aux_loss", Qwen3 MoE) the reference
    is the unshared run of each rank's own groups, gradients summed (`data_parallel_unshared`).
    Under EP x CP the expert weights' gradients are reduced over the expert-data-parallel group, not
    the data-parallel-with-CP one (whose CP ranks hold other experts: `parallel.finish_gradients`)."""
    from parallel_cases import (
        WORKER, aux_by_micro_batch, data_parallel_unshared, ep_micro_batches, max_logprob_diff, micro_batch_weights,
        rank_local_router_statistics, recorded_aux_losses, relative_grad_diffs,
    )

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.parallel.gradients import hf_named_gradients
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.schedule import logprob_pass

    path, _, _ = request.getfixturevalue(checkpoint)
    loaded = load_model(path, PrefixSharingConfig(enabled=True))
    micro_batches = ep_micro_batches()
    loaded.model.zero_grad(set_to_none=True)
    with recorded_aux_losses() as records:
        ref_logprobs = logprob_pass(loaded, micro_batches, share=False, loss_weights=micro_batch_weights(micro_batches))
    ref_aux = aux_by_micro_batch(records)
    ref_grads = hf_named_gradients(loaded.bridge, loaded.model)
    if rank_local_router_statistics(loaded):  # each DP rank's aux loss is that of its own groups
        ref_aux, ref_grads = data_parallel_unshared(loaded, micro_batches, dp_size=2)
    nproc, flags = EP_CASES[case]
    out = tmp_path / "result.pt"
    proc = torchrun(nproc, [WORKER, "--hf-path", path, "--out", str(out), *flags], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    logprob_diff = max_logprob_diff(got["logprobs"], ref_logprobs)
    assert set(got["aux"]) == set(ref_aux) and len(ref_aux) == 2 * MOE_LAYERS[checkpoint], (sorted(got["aux"]), sorted(ref_aux))
    aux_diff = max(abs(got["aux"][k] - v) / abs(v) for k, v in ref_aux.items())
    diffs = relative_grad_diffs(got["grads"], ref_grads)
    print(f"{case}: max |logp| diff {logprob_diff:.2e}, aux loss rel {aux_diff:.2e}, grad rel {max(diffs.values()):.2e}")
    assert logprob_diff <= 1e-5
    assert max_logprob_diff(got["forward_only"], ref_logprobs) <= 1e-5
    assert aux_diff <= 1e-5, (got["aux"], ref_aux)
    wrong = {n: f"{d:.2e}" for n, d in diffs.items() if not d <= 1e-5}
    assert not wrong, wrong


@pytest.mark.slow
def test_bench_smoke_under_expert_parallel(tmp_path):
    """`ps-bridge bench --smoke --ep 2` under torchrun (gloo, float32, tiny Qwen3.5 MoE): each
    data-parallel rank runs 1 of the 2 groups of the row's batch, shared and unshared, with the
    gradients reduced every step; the random replicas are one model (broadcast), so the shared rows
    of both ranks equal the unshared ones and the float32 twin's; rank 0 alone reports, with the
    world layout and the whole batch's token counts."""
    out = tmp_path / "bench.json"
    argv = ["-m", "ps_bridge.tools.cli", "bench", "--smoke", "--ep", "2", "--groups", "2", "--no-progress",
            "--fp32-reference", "--grid", "24,8,4", "--json", str(out)]
    proc = torchrun(2, argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ps-bridge bench on") == 1
    assert "expert parallel 2 (data parallel 2: each rank 1 of the 2 groups" in proc.stdout
    [row] = json.loads(out.read_text())["rows"]
    assert row["model"] == "tiny-qwen3.5-moe" and row["error"] is None, row
    assert row["parallel"] == dict(world_size=2, cp=1, ep=2, data_parallel=2, groups_per_rank=1)
    assert row["tokens_unshared"] == 2 * 4 * (24 + 8) and row["tokens_shared"] == 2 * (24 + 4 * 8)
    assert row["max_logprob_diff"] <= 1e-5 and row["shared_max_err_fp32"] <= 1e-5, row
    assert row["unshared_max_err_fp32"] <= 1e-5 and row["actor_speedup"] > 0


def test_bench_refuses_what_expert_parallel_cannot_split():
    """The bench's own `--ep` limits, before any process group: whole groups, the same number per
    data-parallel rank; MoE shapes only; not with --cp."""
    from ps_bridge.tools.bench.run import _expert_parallel_problem

    def args(**kw):
        return type("Args", (), dict(dict(ep=2, cp=1, groups=4), **kw))()

    assert _expert_parallel_problem(args(), ["tiny-qwen3.5-moe", "qwen3.5-35b-a3b"], 2) is None
    assert "--groups 3 cannot be split evenly across the 2 data-parallel ranks" in _expert_parallel_problem(
        args(groups=3), ["tiny-qwen3.5-moe"], 2)
    assert "use --groups 4" in _expert_parallel_problem(args(groups=6), ["tiny-qwen3.5-moe"], 4)
    assert "needs MoE model shapes; tiny-qwen2.5 has no experts" in _expert_parallel_problem(args(), ["tiny-qwen2.5"], 2)
    assert "not both" in _expert_parallel_problem(args(cp=2), ["tiny-qwen3.5-moe"], 4)
