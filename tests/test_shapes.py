"""Checkpoint shapes the parallel settings do not divide.

A vocabulary TP does not divide is padded (zero rows, kept out of the softmax); a layer count PP
does not divide is split into megatron's uneven first/last stages; what no split can hold (PP
larger than the layer count, heads TP cannot split) is refused before any process group exists,
with one line on every rank and exit status 2.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from ps_bridge.parallel.settings import ModelShapeError, ParallelSettings, pipeline_stage_layers
from ps_bridge.tools.tiny_checkpoints import grpo_like_samples, hf_sample_logprobs

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import free_port, torchrun  # noqa: E402

VOCAB = 157  # odd: TP=2 pads it to 158
LAYERS = 3  # odd: PP=2 splits it 2 + 1


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory):
    """Tiny Qwen2 with vocabulary 157 and 3 layers (4 heads, 2 KV heads: both divide TP=2)."""
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2

    path = tmp_path_factory.mktemp("qwen2_odd")
    hf_model = build_tiny_qwen2(str(path), vocab_size=VOCAB, num_hidden_layers=LAYERS)
    return str(path), hf_model


def odd_samples():
    samples = grpo_like_samples(VOCAB, num_prompts=2, n=3, prompt_len=(5, 12), response_len=(1, 6), seed=5)
    # the last true id, in a prompt and as a label: it lives at the end of TP rank 1's shard
    samples[0].response[-1] = VOCAB - 1
    samples[1].prompt[0] = VOCAB - 1
    return samples


def write_batch(path, samples) -> str:
    path.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    return str(path)


# ---- the split policy and the shape check (no model) ---------------------------------------------


@pytest.mark.parametrize(
    "layers, pp, stages",
    [(3, 2, [2, 1]), (4, 2, [2, 2]), (5, 4, [2, 1, 1, 1]), (10, 4, [2, 3, 3, 2]), (7, 3, [2, 3, 2]), (3, 3, [1, 1, 1])],
)
def test_pipeline_split_policy(layers, pp, stages):
    """The stages megatron builds from our first/last settings (its own TransformerConfig checks and
    get_num_layers_to_build / get_transformer_layer_offset), contiguous and covering every layer."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    first, last = pipeline_stage_layers(layers, pp)
    config = TransformerConfig(
        num_layers=layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
    )
    counts = [get_num_layers_to_build(config, pp_rank=r) for r in range(pp)]
    offsets = [get_transformer_layer_offset(config, pp_rank=r) for r in range(pp)]
    assert counts == stages
    assert offsets == [sum(stages[:r]) for r in range(pp)]


def test_pipeline_split_policy_minimises_the_largest_stage():
    for layers in range(1, 25):
        for pp in range(2, layers + 1):
            first, last = pipeline_stage_layers(layers, pp)
            if first is None:
                assert layers % pp == 0
                continue
            middle = (layers - first - last) // (pp - 2) if pp > 2 else 0
            assert first >= 1 and last >= 1 and first + last + middle * (pp - 2) == layers
            # megatron's middle stages are equal; within that, no split has a smaller largest stage
            best = min(
                max(m, (layers - m * (pp - 2) + 1) // 2)
                for m in range(1 if pp > 2 else 0, layers)
                if layers - m * (pp - 2) >= 2 and (pp > 2 or m == 0)
            )
            assert max(first, last, middle) == best, (layers, pp, first, middle, last)


QWEN2 = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=157)
QWEN35_VL = dict(text_config=dict(QWEN2, num_hidden_layers=4, linear_num_key_heads=4, linear_num_value_heads=6))


@pytest.mark.parametrize(
    "config, tp, pp, message",
    [
        (QWEN2, 1, 4, "pipeline_model_parallel_size=4 (--pp 4) is larger than the checkpoint's 3 layers (num_hidden_layers) and every stage needs one: use --pp 3 or fewer"),
        (QWEN2, 3, 1, "tensor_model_parallel_size=3 (--tp 3) cannot split the checkpoint's num_attention_heads=4 (not divisible by 3): use --tp 1 or 2 or 4"),
        (dict(QWEN2, num_attention_heads=6), 3, 1, "num_key_value_heads=2 (neither a multiple nor a divisor of 3): use --tp 1 or 2"),
        (dict(QWEN2, intermediate_size=130), 4, 1, "intermediate_size=130 (not divisible by 4): use --tp 1 or 2"),
        (QWEN35_VL, 4, 1, "linear_num_value_heads=6 (not divisible by 4): use --tp 1 or 2"),
        (QWEN35_VL, 2, 5, "larger than the checkpoint's 4 layers"),
    ],
)
def test_shape_check_refuses_what_no_split_holds(config, tp, pp, message):
    with pytest.raises(ModelShapeError) as info:
        ParallelSettings(tp=tp, pp=pp).check_model(config)
    assert message in str(info.value)


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2), (4, 3), (1, 3)])
def test_shape_check_accepts_padding_uneven_stages_and_replicated_kv_heads(tp, pp):
    # vocabulary 157 and 3 layers divide neither; TP=4 with 2 KV heads replicates them (megatron)
    ParallelSettings(tp=tp, pp=pp).check_model(QWEN2)


# ---- masking the padded vocabulary (single process) -----------------------------------------------


def test_padded_vocabulary_columns_are_masked_in_every_extractor():
    """Zero logit columns appended to a 157-word vocabulary: every extractor, given the true size,
    returns the unpadded rows and gradient (and the padded columns get no gradient); without it the
    rows differ, so the mask is what makes them equal."""
    from ps_bridge.layout import build_layout
    from ps_bridge.parallel.groups import init_parallel
    from ps_bridge.rows import PackedRows

    init_parallel()  # a world of one: vocab-parallel path with a single TP rank
    layout = build_layout(odd_samples(), share=True)
    torch.manual_seed(0)
    base = torch.randn(layout.num_tokens, VOCAB, dtype=torch.float64).float()
    weights = torch.randn(int(layout.row_label.numel()))

    def rows_and_grad(width, vocab_size=None, **kw):
        logits = torch.cat([base, torch.zeros(layout.num_tokens, width - VOCAB)], dim=1).requires_grad_(True)
        rows = PackedRows(layout, vocab_size=vocab_size).logprobs(logits, **kw)
        (rows * weights).sum().backward()
        return rows.detach(), logits.grad

    def plain(logits):  # the definition, by autograd, over the true vocabulary
        picked = logits.index_select(0, layout.row_source)
        label = layout.row_label
        target = picked.gather(1, label.clamp(min=0)[:, None])[:, 0]
        return torch.where(label >= 0, target - torch.logsumexp(picked, dim=-1), torch.zeros_like(target))

    logits = base.clone().requires_grad_(True)
    ref_rows = plain(logits)
    (ref_rows * weights).sum().backward()
    ref_rows, ref_grad = ref_rows.detach(), logits.grad
    extractors = {"full": dict(), "chunked": dict(chunk_rows=7), "vocab_parallel": dict(vocab_parallel=True)}
    for name, kw in extractors.items():
        rows, grad = rows_and_grad(192, vocab_size=VOCAB, **kw)
        torch.testing.assert_close(rows, ref_rows, rtol=0, atol=2e-6, msg=name)
        torch.testing.assert_close(grad[:, :VOCAB], ref_grad, rtol=0, atol=2e-6, msg=name)
        assert torch.count_nonzero(grad[:, VOCAB:]) == 0, name
        unmasked, _ = rows_and_grad(192, **kw)
        assert (unmasked - ref_rows).abs().max() > 1e-3, name
    # a layout built for the model carries its true vocabulary: masked without being told
    built = build_layout(odd_samples(), share=True, vocab_size=VOCAB)
    assert PackedRows(built).vocab_size == VOCAB


# ---- the CLI under torchrun vs Hugging Face ----------------------------------------------------------


def cli_vs_hf(tmp_path, odd_checkpoint, nproc, flags):
    hf_path, hf_model = odd_checkpoint
    samples = odd_samples()
    batch = write_batch(tmp_path / "batch.json", samples)
    out = tmp_path / "out.json"
    proc = torchrun(nproc, ["-m", "ps_bridge.tools.cli", "logprobs", "--hf-path", hf_path, "--batch", batch, "--out", str(out), *flags])
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    with torch.no_grad():
        refs = hf_sample_logprobs(hf_model, samples)
    for row, ref in zip(got["samples"], refs):
        assert len(row["logprobs"]) == len(ref)
        assert max(abs(a - b) for a, b in zip(row["logprobs"], ref.tolist())) <= 2e-5


CLI_CASES = {
    # default suite: vocabulary padded over TP (with SP), layers split unevenly over PP
    "tp2_sp": (2, ["--tp", "2", "--sp"]),
    "pp2": (2, ["--pp", "2"]),
    # slow
    "tp2": (2, ["--tp", "2"]),
    "tp2_unshared": (2, ["--tp", "2", "--no-prefix-sharing"]),
    "pp2_unshared": (2, ["--pp", "2", "--no-prefix-sharing"]),
    "tp2_pp2": (4, ["--tp", "2", "--pp", "2"]),
}
SLOW = {"tp2", "tp2_unshared", "pp2_unshared", "tp2_pp2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CLI_CASES])
def test_cli_logprobs_with_shapes_that_do_not_divide_equal_hf(name, tmp_path, odd_checkpoint):
    nproc, flags = CLI_CASES[name]
    cli_vs_hf(tmp_path, odd_checkpoint, nproc, flags)


# ---- refusals: one line on every rank, exit status 2, no process group ---------------------------


def test_pipeline_larger_than_the_layer_count_is_refused_on_every_rank(tmp_path, odd_checkpoint):
    """`--pp 4` on 3 layers, each rank started the way torchrun starts it (world of 2: the shape is
    reported before the world size, as no launch would fix it). Nothing listens at
    MASTER_ADDR:MASTER_PORT, so a rank that created a process group would hang; each must print the
    same single line and exit 2 on its own, writing nothing."""
    batch = write_batch(tmp_path / "batch.json", odd_samples())
    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "ps_bridge.tools.cli", "logprobs", "--hf-path", odd_checkpoint[0], "--batch", batch,
            "--out", str(out), "--pp", "4"]
    port, world = free_port(), 2
    procs = []
    for rank in range(world):
        env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    expected = ("ps-bridge: error: pipeline_model_parallel_size=4 (--pp 4) is larger than the checkpoint's 3 layers "
                "(num_hidden_layers) and every stage needs one: use --pp 3 or fewer")
    for rank, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, f"rank {rank}: {stderr[-3000:]}"
        assert "Traceback" not in stderr and stdout == "", f"rank {rank}: {stderr[-3000:]}"
        assert [line for line in stderr.splitlines() if line.startswith("ps-bridge")] == [expected], stderr
        assert stderr.strip().splitlines()[-1] == expected
    assert not out.exists()


@pytest.mark.slow
def test_pipeline_larger_than_the_layer_count_is_refused_under_torchrun(tmp_path, odd_checkpoint):
    batch = write_batch(tmp_path / "batch.json", odd_samples())
    out = tmp_path / "out.json"
    proc = torchrun(4, ["-m", "ps_bridge.tools.cli", "logprobs", "--hf-path", odd_checkpoint[0], "--batch", batch,
                        "--out", str(out), "--pp", "4"])
    assert proc.returncode != 0
    assert "ps-bridge: error: pipeline_model_parallel_size=4 (--pp 4) is larger than the checkpoint's 3 layers" in proc.stderr
    assert "exitcode  : 2" in proc.stderr or "exitcode: 2" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


# ---- Qwen3.5: the hybrid block spec under uneven stages ------------------------------------------


def test_qwen35_block_spec_builds_each_uneven_stage_from_its_own_layers():
    """Qwen3.5's spec picks its stage's layers (Gated DeltaNet or attention, in the checkpoint's
    order) through megatron's offset / count, which follow the uneven first/last stages."""
    from transformers import Qwen3_5TextConfig

    from ps_bridge.compat.te_placeholder import import_megatron_bridge
    from ps_bridge.models.gdn import PrefixSharedGatedDeltaNet
    from ps_bridge.models.qwen35_specs import prefix_shared_qwen35_block_spec
    from ps_bridge.parallel.settings import configure_provider
    from ps_bridge.providers.registry import register_all
    from ps_bridge.tools.tiny_checkpoints import _tiny_qwen35_text_kwargs

    import_megatron_bridge()
    register_all()
    from megatron.bridge import AutoBridge

    kwargs = _tiny_qwen35_text_kwargs(moe=False)
    kinds = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
    hf_config = Qwen3_5TextConfig(**dict(kwargs, num_hidden_layers=5, layer_types=kinds))
    hf_config.architectures = ["Qwen3_5ForCausalLM"]
    provider = AutoBridge.from_hf_config(hf_config).to_megatron_provider(load_weights=False)
    configure_provider(provider, ParallelSettings(pp=3))
    provider.pipeline_dtype = torch.float32
    provider.finalize()
    assert (provider.num_layers_in_first_pipeline_stage, provider.num_layers_in_last_pipeline_stage) == (2, 1)
    built = []
    for rank in range(3):
        block = prefix_shared_qwen35_block_spec(provider, pp_rank=rank)
        built += ["linear_attention" if spec.submodules.self_attention.module is PrefixSharedGatedDeltaNet
                  else "full_attention" for spec in block.layer_specs]
        assert len(block.layer_specs) == [2, 2, 1][rank]
    assert built == kinds


# ---- more checkpoints (slow) ------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_with_fewer_kv_heads_than_tp_ranks_equals_hf(tmp_path):
    """One KV head on two TP ranks: megatron replicates it (the shape check accepts it)."""
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2

    path = tmp_path / "kv1"
    hf_model = build_tiny_qwen2(str(path), vocab_size=VOCAB, num_hidden_layers=LAYERS, num_key_value_heads=1)
    cli_vs_hf(tmp_path, (str(path), hf_model), 2, ["--tp", "2"])


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--pp", "2"], ["--tp", "2"]], ids=["pp2", "tp2"])
def test_cli_qwen35_with_shapes_that_do_not_divide_equals_hf(flags, tmp_path):
    """Qwen3.5 (Gated DeltaNet + attention) with vocabulary 157 and 3 layers."""
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen35

    path = tmp_path / "q35"
    hf_model = build_tiny_qwen35(
        str(path), vocab_size=VOCAB, num_hidden_layers=LAYERS,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )
    cli_vs_hf(tmp_path, (str(path), hf_model), 2, flags)
