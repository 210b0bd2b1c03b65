"""Qwen3.5 ConditionalGeneration (dense and MoE) with image prompts under TP=2+SP, PP=2 and CP=2 on CPU
(gloo, torchrun): the prefix-shared parallel run gives the log-probs and every HF-named gradient (the
vision tower's included) of the single-rank unshared run, where the tower ran once per image of every
sample. The dense model's text-only path at CP=2 as well."""

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


# The MoE model at CP=2: log-probs equal (4.8e-7) but the routers' gate gradients differ from the single-rank
# unshared run by up to 8.5e-2 relative (the vision tower's by 4.7e-3, through the load-balancing loss's
# gradient). Megatron-Bridge's Qwen3.5 VL provider turns on calculate_per_token_loss under CP
# (megatron/bridge/models/qwen_vl/qwen35_vl_provider.py, finalize); megatron then multiplies each rank's
# load-balancing loss by that rank's token count x the TP x CP size (megatron/core/transformer/moe/router.py,
# attach_and_log_load_balancing_loss) and sets its backward scale to 1 (megatron/core/pipeline_parallel/
# schedules.py, forward_step), leaving the division by the global token count to the trainer; the CP=1
# reference runs without it. The load-balancing gradient then depends on how the pack's tokens fall on the
# CP ranks, which sharing changes. Without that loss the CP=2 run is exact (the test below).
MOE_CP2_GATES = pytest.mark.xfail(strict=True, reason="MoE ConditionalGeneration at CP=2: the load-balancing "
                                  "loss follows calculate_per_token_loss, which the VL provider turns on")
CASES = [("qwen3.5-vl", c) for c in sorted(CONFIGS)] + [
    ("qwen3.5-moe-vl", "pp2"), ("qwen3.5-moe-vl", "tp2_sp"),
    pytest.param("qwen3.5-moe-vl", "cp2", marks=MOE_CP2_GATES),
]


def test_moe_image_batches_at_cp2_without_the_load_balancing_loss(vl_cases, tmp_path):
    path, refs = vl_cases("qwen3.5-moe-vl", router_aux_loss_coef=0.0)
    _, got = parallel_run(path, CONFIGS["cp2"], "images", tmp_path)
    assert max_logprob_diff(got["logprobs"], refs["images"]["logprobs"]) <= 2e-5
    grads = relative_grad_diffs(got["grads"], refs["images"]["grads"])
    assert any(".visual." in n for n in grads) and max(grads.values()) <= 1e-5, max(grads.values())


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
