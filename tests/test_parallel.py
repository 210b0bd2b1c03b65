"""TP, TP-bound SP and physical PP on CPU with gloo, launched with `torchrun`.

Each parallel run (prefix-shared, three micro-batches of different packed lengths, one group split
across two of them) must give the log-probs and the full gradients of the single-rank *unshared*
run, print its `[PS]` lines on every rank, and the CLI must run under torchrun (context parallelism:
tests/test_context_parallel.py).
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import (  # noqa: E402
    PADDING_EXAMPLE,
    WORKER,
    max_logprob_diff,
    parallel_micro_batches,
    relative_grad_diffs,
    run_and_compare,
    tied_checkpoint,  # noqa: F401 (fixture)
    tied_unshared_reference,  # noqa: F401 (fixture)
    torchrun,
    unshared_reference,  # noqa: F401 (fixture)
)

# name: (processes, worker flags, tp, pp, tied embeddings)
CONFIGS = {
    "tp2": (2, ["--tp", "2"], 2, 1, False),
    "tp2_sp": (2, ["--tp", "2", "--sp"], 2, 1, False),
    "pp2_tied_embeddings": (2, ["--pp", "2"], 1, 2, True),
    "tp2_sp_pp2": (4, ["--tp", "2", "--sp", "--pp", "2"], 2, 2, False),
}


# TP=2 + SP alone is behind the slow marker: the default tp2_sp_pp2 case (4 ranks) runs TP + SP on each stage
SLOW_CONFIGS = {"tp2_sp"}


# the oldest tested stack runs TP=2 (`core`)
CORE_CONFIGS = {"tp2"}


def _marks(name):
    return [m for m, on in ((pytest.mark.slow, name in SLOW_CONFIGS), (pytest.mark.core, name in CORE_CONFIGS)) if on]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CONFIGS])
def test_parallel_run_equals_single_rank_unshared(name, tmp_path, request):
    nproc, flags, tp, pp, tied = CONFIGS[name]
    if tied:
        hf_path, ref = request.getfixturevalue("tied_checkpoint"), request.getfixturevalue("tied_unshared_reference")
        assert "lm_head.weight" not in ref["grads"]
    else:
        hf_path, ref = request.getfixturevalue("qwen2_checkpoint")[0], request.getfixturevalue("unshared_reference")
    run_and_compare(name, nproc, flags, tp, pp, hf_path, ref, tmp_path)


def test_unfinished_sequence_parallel_gradients_are_detected(tmp_path, qwen2_checkpoint, unshared_reference):
    """Negative control: without the TP sum of the SP norms' partial gradients the comparison fails."""
    out = tmp_path / "result.pt"
    proc = torchrun(2, [WORKER, "--hf-path", qwen2_checkpoint[0], "--out", str(out), "--tp", "2", "--sp", "--skip-finish-gradients"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    diffs = relative_grad_diffs(torch.load(out)["grads"], unshared_reference["grads"])
    assert diffs["model.norm.weight"] > 1e-2
    assert diffs["model.layers.0.self_attn.q_proj.weight"] <= 1e-5  # TP-sharded weights are unaffected


def write_batch(path: Path) -> str:
    samples = [s for mb in parallel_micro_batches() for s in mb]
    path.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    return str(path)


def test_cli_logprobs_under_torchrun_equals_single_process(tmp_path, qwen2_checkpoint):
    from ps_bridge.tools.cli import main

    batch = write_batch(tmp_path / "batch.json")
    single, parallel = tmp_path / "single.json", tmp_path / "parallel.json"
    assert main(["logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", batch, "--out", str(single)]) == 0
    proc = torchrun(
        2,
        ["-m", "ps_bridge.tools.cli", "-v", "logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", batch,
         "--out", str(parallel), "--tp", "2", "--sp"],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("wrote ") == 1, proc.stdout  # rank 0 only
    a, b = json.loads(single.read_text()), json.loads(parallel.read_text())
    assert a.keys() == b.keys()
    assert {k: v for k, v in a.items() if k != "samples"} == {k: v for k, v in b.items() if k != "samples"}
    for sa, sb in zip(a["samples"], b["samples"]):
        assert len(sa["logprobs"]) == len(sb["logprobs"])
        assert max(abs(x - y) for x, y in zip(sa["logprobs"], sb["logprobs"])) <= 1e-5
    for rank in (0, 1):
        assert f"[PS][prepare][global_rank={rank} tp_rank={rank}/tp_size=2 cp_rank=0/cp_size=1] packed_batch_layout:" in proc.stderr


def test_cli_quiet_by_default_under_torchrun_and_demo_prints_once(tmp_path):
    """Without -v no rank prints [PS] lines; the demo's table comes from rank 0 only and agrees."""
    proc = torchrun(2, ["-m", "ps_bridge.tools.cli", "demo", "--json", "--pp", "2", "--prompts", "2", "--responses", "3"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[PS]" not in proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert (result["tp"], result["pp"], result["sp"]) == (1, 2, False)
    assert result["max_logprob_diff_shared_vs_hf"] <= 1e-5
    assert result["max_logprob_diff_shared_vs_unshared"] <= 1e-5
    assert result["max_rel_grad_diff_shared_vs_unshared"] <= 1e-5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cp", "2"], "world size 1 is not divisible by tensor x pipeline x context parallel size 1 x 1 x 2"),
        (["--sp"], "sequence_parallel=True needs tensor_model_parallel_size > 1"),
        (["--tp", "2"], "world size 1 is not divisible by tensor x pipeline x context parallel size"),
        (["--pp", "0"], "pipeline_model_parallel_size must be >= 1, got 0"),
        (["--cp", "0"], "context_parallel_size must be >= 1, got 0"),
    ],
)
def test_cli_refuses_bad_parallel_settings(tmp_path, qwen2_checkpoint, capsys, argv, message):
    from ps_bridge.tools.cli import main

    batch = write_batch(tmp_path / "batch.json")
    code = main(["logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", batch, "--out", str(tmp_path / "o.json"), *argv])
    err = capsys.readouterr().err
    last_line = err.strip().splitlines()[-1]  # library warnings from the first import may come before it
    assert code == 2 and last_line.startswith("ps-bridge: error: ") and message in last_line, err


def test_virtual_pipeline_is_refused_by_settings():
    from ps_bridge.parallel.settings import ParallelSettings

    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=2"):
        ParallelSettings(pp=2, vpp=2).check(world_size=2)


def test_attention_refuses_a_sequence_parallel_shard(qwen2_loaded):
    """If the hook were handed an SP-local shard (half the packed tokens), it raises, naming SP."""
    from ps_bridge.layout import build_layout
    from ps_bridge.models.attention import PrefixSharedCoreAttention
    from ps_bridge.models.packed_seq import PrefixSharedPackedSeqParams

    core = next(m for m in qwen2_loaded.model.modules() if isinstance(m, PrefixSharedCoreAttention))
    layout = build_layout(parallel_micro_batches()[1], share=True, pad_multiple=2)
    params = PrefixSharedPackedSeqParams.from_layout(layout)
    shard = layout.num_tokens // 2
    q = torch.randn(shard, 4, 16)
    kv = torch.randn(shard, 2, 16)
    with pytest.raises(ValueError, match="sequence-parallel local shard"):
        core(q, kv, kv, None, packed_seq_params=params)


def test_padding_example_pads_to_the_tensor_parallel_multiple():
    from ps_bridge.layout import build_layout

    layout = build_layout([PADDING_EXAMPLE], share=True, pad_multiple=2)
    assert layout.host["valid_lengths"] == [5, 2] and layout.host["padded_lengths"] == [6, 2]
    assert layout.num_tokens % 2 == 0


def test_sequence_parallel_norms_replace_torch_norms_through_a_block_spec():
    """A hybrid family's block spec (a list of layer specs) gets SP-capable norms in every layer."""
    from types import SimpleNamespace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from ps_bridge.models.norms import TorchNormForSequenceParallel
    from ps_bridge.models.specs import with_sequence_parallel_norms

    layers = [get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True) for _ in range(2)]
    block = with_sequence_parallel_norms(TransformerBlockSubmodules(layer_specs=layers, layer_norm=WrappedTorchNorm))
    assert block.layer_norm is TorchNormForSequenceParallel
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention.submodules
        assert layer.submodules.input_layernorm is TorchNormForSequenceParallel
        assert layer.submodules.pre_mlp_layernorm is TorchNormForSequenceParallel
        assert attention.q_layernorm is TorchNormForSequenceParallel and attention.k_layernorm is TorchNormForSequenceParallel

    config = SimpleNamespace(layernorm_zero_centered_gamma=False, normalization="RMSNorm", sequence_parallel=True)
    norm = TorchNormForSequenceParallel(config, hidden_size=8)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
