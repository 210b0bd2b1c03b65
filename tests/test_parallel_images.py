"""Qwen3.5 ConditionalGeneration (dense and MoE) with image prompts under TP=2+SP, PP=2 and CP=2 on CPU
(gloo, torchrun): the prefix-shared parallel run gives the log-probs and every HF-named gradient (the
vision tower's included) of the single-rank unshared run, where the tower ran once per image of every
sample. The dense model's text-only path at CP=2 as well. The MoE model at CP=2 with its load-balancing
loss runs in megatron's per-token regime: compared with the unshared CP=2 run and a single-rank run in
that regime."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import WORKER, max_logprob_diff, relative_grad_diffs, single_rank_unshared, torchrun  # noqa: E402

pytestmark = pytest.mark.slow

CONFIGS = {"tp2_sp": ["--tp", "2", "--sp"], "pp2": ["--pp", "2"], "cp2": ["--cp", "2"]}


@pytest.fixture(scope="module")
def vl_cases(tmp_path_factory):
    """Per architecture (built on first use): the checkpoint and its single-rank unshared references."""
    from qwen35_helpers import skip_where_vl_refused
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    skip_where_vl_refused()
    cache = {}

    def get(arch, **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(arch.replace(".", "_")))
            TINY_BUILDERS[arch](path, **overrides)
            loaded = load_model(path, PrefixSharingConfig(enabled=True))
            cache[key] = path, {cases: single_rank_unshared(loaded, cases=cases) for cases in ("images", "ep")}
        return cache[key]

    return get


@pytest.fixture(scope="module")
def vl_case(vl_cases):
    return vl_cases("qwen3.5-vl")


def parallel_run(path, flags, cases, tmp_path):
    out = tmp_path / "result.pt"
    proc = torchrun(2, [WORKER, "--hf-path", path, "--out", str(out), "--cases", cases, *flags], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, torch.load(out)


# The MoE model at CP=2 runs in megatron's per-token regime: Megatron-Bridge's Qwen3.5 VL provider turns on
# calculate_per_token_loss under CP (megatron/bridge/models/qwen_vl/qwen35_vl_provider.py, finalize), the
# single-rank run has it off, and the two regimes scale the load-balancing loss's gradient differently by
# design (megatron/core/pipeline_parallel/schedules.py, forward_step; the per-token trainer divides by the
# global token count). So the CP=2 case is compared without that loss against the single-rank run, and with
# it against the unshared CP=2 run and a single-rank run set to the per-token regime (the tests below).
CASES = [("qwen3.5-vl", c) for c in sorted(CONFIGS)] + [("qwen3.5-moe-vl", "pp2"), ("qwen3.5-moe-vl", "tp2_sp")]


def test_moe_image_batches_at_cp2_without_the_load_balancing_loss(vl_cases, tmp_path):
    path, refs = vl_cases("qwen3.5-moe-vl", router_aux_loss_coef=0.0)
    _, got = parallel_run(path, CONFIGS["cp2"], "images", tmp_path)
    assert max_logprob_diff(got["logprobs"], refs["images"]["logprobs"]) <= 2e-5
    grads = relative_grad_diffs(got["grads"], refs["images"]["grads"])
    assert any(".visual." in n for n in grads) and max(grads.values()) <= 1e-5, max(grads.values())


def per_token_regime(loaded, cp: int) -> None:
    """Set the single-rank model to the MoE loss scaling of a CP run of `logprob_pass`: megatron's
    per-token regime (`calculate_per_token_loss` on the config the schedule reads and on every router),
    with the load-balancing coefficient divided by `cp`. In that regime megatron's schedule gives the
    load-balancing loss a backward scale of 1 and each router attaches its share x count x TP/CP size
    (megatron/core/transformer/moe/router.py, attach_and_log_load_balancing_loss), which is the share x
    the micro-batch's token count N on every rank (`PrefixSharedTopKRouter._per_token_count`); our
    (loss, data) loss is scaled by the CP size instead, which `finish_gradients` divides out of every
    gradient, so a CP run's load-balancing gradient is N / cp times the loss's. The loss is linear in
    its coefficient."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.utils import get_model_config

    routers = [m for m in loaded.model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(r.is_aux_loss_enabled() for r in routers)
    configs = {id(c): c for c in [get_model_config(loaded.model), *(r.config for r in routers)]}
    for config in configs.values():
        config.calculate_per_token_loss = True
        coeff = config.moe_aux_loss_coeff
        config.moe_aux_loss_coeff = [c / cp for c in coeff] if isinstance(coeff, list) else coeff / cp
    for router in routers:
        router.calculate_per_token_loss = True


@pytest.fixture(scope="module", params=["global_aux_loss", "aux_loss"])
def moe_cp2_runs(request, vl_cases, tmp_path_factory):
    """The MoE model with a load-balancing loss at CP=2, shared and unshared, and the single-rank
    unshared run in the per-token regime (`per_token_regime`). Qwen3.5's "global_aux_loss" (statistics
    over TP x DP x CP, averaged over the micro-batches) and megatron's "aux_loss" (over TP x CP, per
    micro-batch)."""
    from parallel_cases import provider_settings_on_build

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.runtime import load_model

    path, _ = vl_cases("qwen3.5-moe-vl")
    kind = ["--moe-load-balancing", request.param]
    runs = {name: parallel_run(path, CONFIGS["cp2"] + kind + flags, "images", tmp_path_factory.mktemp(name))
            for name, flags in (("shared", []), ("unshared", ["--unshared"]))}
    with provider_settings_on_build(moe_router_load_balancing_type=request.param):
        loaded = load_model(path, PrefixSharingConfig(enabled=True))
    assert all(r.routing_type == request.param for r in loaded.model.modules() if hasattr(r, "routing_type"))
    per_token_regime(loaded, cp=2)
    return request.param, runs, single_rank_unshared(loaded, cases="images")


def test_moe_image_batches_at_cp2_with_the_load_balancing_loss_shared_equal_unshared(moe_cp2_runs):
    """With the load-balancing loss at CP=2 (per-token regime) the shared run's gradients equal the unshared
    run's: each rank's loss share is scaled by the TP/CP mean count x the TP/CP size (the micro-batch's token
    count), not by its own CP shard's weighted count x that size, which sharing changes (the zigzag split
    puts prompt tokens of weight n unevenly)."""
    kind, runs, _ = moe_cp2_runs
    (proc, shared), (unshared_proc, unshared) = runs["shared"], runs["unshared"]
    assert "PATH 6: sharing detected" in proc.stderr and "PATH 6: sharing detected" not in unshared_proc.stderr
    grads = relative_grad_diffs(shared["grads"], unshared["grads"])
    logprob_diff = max_logprob_diff(shared["logprobs"], unshared["logprobs"])
    print(f"qwen3.5-moe-vl cp2 {kind} shared vs unshared: max |logp| diff {logprob_diff:.2e}, "
          f"max relative grad diff {max(grads.values()):.2e}")
    assert logprob_diff <= 2e-5
    assert any(".visual." in n for n in grads)
    assert max(grads.values()) <= 1e-5, {n: d for n, d in grads.items() if d > 1e-5}


@pytest.mark.parametrize("run", ["shared", "unshared"])
def test_moe_image_batches_at_cp2_with_the_load_balancing_loss_equal_single_rank_per_token(run, moe_cp2_runs):
    """Both CP=2 runs equal the single-rank unshared run in the per-token regime (`per_token_regime`): the
    gradient does not depend on how the pack's tokens fall on the CP ranks. The unshared run's CP ranks hold
    unequal counts too: a sequence is padded to a multiple of 2 x CP and padding weighs 0 (here 46 and 45, 72
    and 69 real tokens); the TP/CP mean of the counts gives count x TP/CP size = the micro-batch's real token
    count on both, the single rank's count, where each rank's own count would scale its share unequally."""
    kind, runs, ref = moe_cp2_runs
    _, got = runs[run]
    grads = relative_grad_diffs(got["grads"], ref["grads"])
    print(f"qwen3.5-moe-vl cp2 {kind} {run} vs single rank per-token: max |logp| diff "
          f"{max_logprob_diff(got['logprobs'], ref['logprobs']):.2e}, max relative grad diff {max(grads.values()):.2e}")
    assert max_logprob_diff(got["logprobs"], ref["logprobs"]) <= 2e-5
    assert max(grads.values()) <= 1e-5, {n: d for n, d in grads.items() if d > 1e-5}


@pytest.mark.parametrize("arch, config", CASES)
def test_image_batches_parallel_equal_single_rank_unshared(arch, config, vl_cases, tmp_path):
    path, refs = vl_cases(arch)
    ref = refs["images"]
    proc, got = parallel_run(path, CONFIGS[config], "images", tmp_path)
    grads = relative_grad_diffs(got["grads"], ref["grads"])
    vision = {n: d for n, d in grads.items() if ".visual." in n}
    print(f"{arch} {config}: max |logp| diff {max_logprob_diff(got['logprobs'], ref['logprobs']):.2e}, "
          f"max relative grad diff {max(grads.values()):.2e} (vision tower {max(vision.values()):.2e})")
    assert vision and any("merger" in n for n in vision)
    assert max_logprob_diff(got["logprobs"], ref["logprobs"]) <= 2e-5
    assert max_logprob_diff(got["forward_only"], ref["logprobs"]) <= 2e-5
    assert max(grads.values()) <= 1e-5, {n: d for n, d in grads.items() if d > 1e-5}
    assert "[PS][prepare] PATH 6: sharing detected" in proc.stderr and "images=" in proc.stderr


def test_text_batches_of_the_vl_model_under_context_parallelism(vl_case, tmp_path):
    """The ConditionalGeneration model's text-only path at CP=2 (its mRoPE rows equal, in megatron's
    CP order) equals the single-rank unshared run."""
    path, refs = vl_case
    _, got = parallel_run(path, ["--cp", "2"], "ep", tmp_path)
    assert max_logprob_diff(got["logprobs"], refs["ep"]["logprobs"]) <= 2e-5
    grads = relative_grad_diffs(got["grads"], refs["ep"]["grads"])
    assert max(d for n, d in grads.items() if ".visual." not in n) <= 1e-5
