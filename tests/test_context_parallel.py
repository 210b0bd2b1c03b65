"""Context parallelism (CP) with prefix sharing, on CPU with gloo, launched with `torchrun`.

Head-parallel CP over contiguous shards (`models/context_parallel.py`): each CP rank runs one
contiguous shard of the pack position-wise, attention and Gated DeltaNet run on the whole pack
with heads / cp heads between two megatron all-to-alls. Every CP run (prefix-shared) must give the
log-probs and every HF-named gradient of the single-rank *unshared* run, within 1e-5, on fuzzed
micro-batches (`parallel_cases.cp_micro_batches`: random group sizes and lengths, a group split
across micro-batches, shard boundaries right at a prompt's last token); the CLI under
`torchrun --cp 2` equals Hugging Face within 2e-5. One 2-rank case runs by default, the rest are
`slow`.
"""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import cp_micro_batches, run_and_compare, single_rank_unshared, torchrun  # noqa: E402

# Qwen3.5 at CP=2 x TP=2: the tiny checkpoint's 2 GDN key heads give 1 per TP rank, which CP=2
# cannot split; this one has 4 (and 4 value heads)
QWEN35_TP_CP = dict(linear_num_key_heads=4, linear_num_value_heads=4)

# name: (architecture, checkpoint overrides, processes, worker flags, tp, pp, cp, default suite)
CASES = {
    "qwen2.5_cp2": ("qwen2.5", {}, 2, ["--cp", "2"], 1, 1, 2, True),
    "qwen3.5_cp2": ("qwen3.5", {}, 2, ["--cp", "2"], 1, 1, 2, False),
    "qwen3.5-moe_cp2": ("qwen3.5-moe", {}, 2, ["--cp", "2"], 1, 1, 2, False),
    "qwen2.5_cp2_tp2": ("qwen2.5", {}, 4, ["--cp", "2", "--tp", "2"], 2, 1, 2, False),
    "qwen3.5_cp2_tp2_sp": ("qwen3.5", QWEN35_TP_CP, 4, ["--cp", "2", "--tp", "2", "--sp"], 2, 1, 2, False),
    "qwen2.5_cp2_pp2": ("qwen2.5", {}, 4, ["--cp", "2", "--pp", "2"], 1, 2, 2, False),
}
# the oldest tested stack runs CP=2 of Qwen2.5 (attention) and Qwen3.5 (Gated DeltaNet's all-to-alls
# through ps_bridge/compat/megatron_core.py) (`core`)
CORE_CASES = {"qwen2.5_cp2", "qwen3.5_cp2"}


@pytest.fixture(scope="module")
def cp_case(tmp_path_factory):
    """(checkpoint path, single-rank unshared reference on the CP micro-batches), built once each."""
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    cache = {}

    def get(arch, overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(arch))
            TINY_BUILDERS[arch](path, **overrides)
            ref = single_rank_unshared(load_model(path, PrefixSharingConfig(enabled=True)), cases="cp")
            cache[key] = (path, ref)
        return cache[key]

    return get


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=([] if c[-1] else [pytest.mark.slow]) + ([pytest.mark.core] if n in CORE_CASES else []))
        for n, c in CASES.items()
    ],
)
def test_context_parallel_run_equals_single_rank_unshared(name, cp_case, tmp_path):
    arch, overrides, nproc, flags, tp, pp, cp, _ = CASES[name]
    hf_path, ref = cp_case(arch, overrides)
    run_and_compare(name, nproc, flags, tp, pp, hf_path, ref, tmp_path, cp=cp, cases="cp")


@pytest.mark.slow
def test_unreduced_context_parallel_gradients_are_detected(cp_case, tmp_path):
    """Negative control: without the mean over the CP group each rank holds only the gradient of its
    own shard's rows (times CP), and the comparison with the unshared run fails for every weight."""
    from parallel_cases import WORKER, relative_grad_diffs

    hf_path, ref = cp_case("qwen2.5", {})
    out = tmp_path / "result.pt"
    proc = torchrun(2, [WORKER, "--hf-path", hf_path, "--out", str(out), "--cases", "cp", "--cp", "2", "--skip-finish-gradients"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    diffs = relative_grad_diffs(torch.load(out)["grads"], ref["grads"])
    assert min(diffs.values()) > 1e-2, diffs


# ---- CLI under torchrun vs Hugging Face ------------------------------------------------------


def _hf_logprobs(hf_path, samples):
    from ps_bridge.tools.compare import hf_logprobs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    return hf_logprobs(model, samples)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2.5", "qwen3.5", "qwen3.5-moe"])
@pytest.mark.parametrize("share", [True, False])
def test_cli_logprobs_under_context_parallel_equals_hugging_face(arch, share, tmp_path):
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    path = str(tmp_path / arch)
    TINY_BUILDERS[arch](path)
    samples = [s for mb in cp_micro_batches(3)[:4] for s in mb]
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    out = tmp_path / "out.json"
    argv = ["-m", "ps_bridge.tools.cli", "-v", "logprobs", "--hf-path", path, "--batch", str(batch), "--out", str(out), "--cp", "2"]
    proc = torchrun(2, argv + ([] if share else ["--no-prefix-sharing"]), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cp_rank=1/cp_size=2] cp_shard=" in proc.stderr
    got = [torch.tensor(s["logprobs"]) for s in json.loads(out.read_text())["samples"]]
    ref = _hf_logprobs(path, samples)
    diff = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    print(f"{arch} share={share}: max |logp - HF| {diff:.2e}")
    assert diff <= 2e-5


# ---- pieces, single process ------------------------------------------------------------------


def test_edge_micro_batches_put_the_shard_boundary_at_a_prompts_last_token():
    """The fuzzed cases really contain the edges they claim (CP=2, TP=1: packs of 16, boundary 8)."""
    from ps_bridge.layout import build_layout

    last_of_shard0, first_of_shard1 = cp_micro_batches(0)[:2]
    for samples, last_prompt_position in ((last_of_shard0, 7), (first_of_shard1, 8)):
        layout = build_layout(samples, share=True, total_multiple=4)
        assert layout.num_tokens == 16 and layout.cp_shard(0, 2) == slice(0, 8)
        assert layout.host["valid_lengths"][0] - 1 == last_prompt_position
    assert cp_micro_batches(5) == cp_micro_batches(5) and cp_micro_batches(5) != cp_micro_batches(6)


def test_layout_pads_the_pack_for_context_parallel_shards():
    from ps_bridge.layout import build_layout

    samples = cp_micro_batches(1)[2]
    plain = build_layout(samples, share=True, pad_multiple=2)
    padded = build_layout(samples, share=True, pad_multiple=2, total_multiple=8)
    assert padded.num_tokens % 8 == 0 and padded.num_tokens - plain.num_tokens < 8
    assert padded.host["padded_lengths"][:-1] == plain.host["padded_lengths"][:-1]
    assert padded.host["valid_lengths"] == plain.host["valid_lengths"]
    bad = next(c for c in (3, 5, 7, 11, 13) if padded.num_tokens % c)
    with pytest.raises(ValueError, match=f"not divisible by context_parallel_size={bad}"):
        padded.cp_shard(0, bad)


def test_rope_table_lands_where_megatrons_cp_rope_reads_it():
    """megatron's THD RoPE under CP hands rank r its load-balanced rows of the table; after
    `cp_rope_table` those are exactly rank r's contiguous shard of the per-token table."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    from ps_bridge.models.gpt_model import cp_rope_table

    T, cp = 24, 3
    table = torch.arange(T, dtype=torch.float32)[:, None, None, None].expand(T, 1, 1, 4).contiguous()
    reordered = cp_rope_table(table, cp)
    for r in range(cp):
        local = torch.empty(T // cp, 1, 4)
        got = _get_thd_freqs_on_this_cp_rank(r, cp, local, reordered, 0)
        assert torch.equal(got, table[r * T // cp : (r + 1) * T // cp])


def test_rows_of_a_shard_sum_to_the_full_rows():
    """The one row extractor on each CP shard's logits: every row position (fork rows included) is
    computed by exactly one shard, and the shards' rows add up to the full rows."""
    from ps_bridge.layout import build_layout
    from ps_bridge.rows import PackedRows

    for samples in cp_micro_batches(2)[:4]:
        layout = build_layout(samples, share=True, total_multiple=4)
        logits = torch.randn(layout.num_tokens, 300, dtype=torch.float64)
        full = PackedRows(layout).logprobs(logits)
        parts = []
        for r in range(2):
            shard = layout.cp_shard(r, 2)
            parts.append(PackedRows(layout, cp_shard=shard).logprobs(logits[shard]))
        assert torch.allclose(parts[0] + parts[1], full, atol=1e-12)
        assert not ((parts[0] != 0) & (parts[1] != 0)).any()


def test_context_parallel_settings():
    """CP is accepted by the one check (dynamic CP and VPP stay refused); head counts CP cannot split
    are refused naming the numbers; KV heads fewer than CP are repeated, not refused."""
    from ps_bridge.models.context_parallel import kv_repeat
    from ps_bridge.parallel.settings import ModelShapeError, ParallelSettings

    ParallelSettings(tp=2, cp=2, sequence_parallel=True, pp=2).check_supported()
    with pytest.raises(ValueError, match="dynamic_context_parallel"):
        ParallelSettings(cp=2, dynamic_cp=True).check_supported()
    # the verl engine takes static CP too; dynamic CP and virtual pipeline stages stay refused there
    ParallelSettings(tp=2, cp=2, sequence_parallel=True).check_supported()
    with pytest.raises(ValueError, match="dynamic_context_parallel"):
        ParallelSettings(cp=2, dynamic_cp=True).check_supported()
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=2"):
        ParallelSettings(pp=2, cp=2, vpp=2).check_supported()
    qwen = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    ParallelSettings(tp=2, cp=2).check(world_size=4, hf_config=qwen)  # 1 KV head per TP rank: repeated
    with pytest.raises(ModelShapeError, match=r"--cp 4.*4 query heads per TP rank|num_attention_heads=4 gives 2 query heads per TP rank, not divisible by 4"):
        ParallelSettings(tp=2, cp=4).check(world_size=8, hf_config=qwen)
    gdn = dict(qwen, linear_num_key_heads=2, linear_num_value_heads=4)
    with pytest.raises(ModelShapeError, match="linear_num_key_heads=2 gives 1 heads per TP rank, not divisible by 2"):
        ParallelSettings(tp=2, cp=2).check(world_size=4, hf_config=gdn)
    assert [kv_repeat(h, 2) for h in (1, 2, 3, 4)] == [2, 1, 2, 1] and kv_repeat(2, 8) == 4


def test_cli_refuses_heads_context_parallel_cannot_split(tmp_path, qwen2_checkpoint, capsys):
    """4 query heads on 2 TP ranks leave 2 per rank, which CP=4 cannot split: refused before any
    process group, naming the numbers (the world size is not even looked at)."""
    from ps_bridge.tools.cli import main

    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"samples": [{"prompt": [1, 2, 3], "response": [4, 5]}]}))
    argv = ["logprobs", "--hf-path", qwen2_checkpoint[0], "--batch", str(batch), "--out", str(tmp_path / "o.json")]
    code = main(argv + ["--tp", "2", "--cp", "4"])
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last_line.startswith("ps-bridge: error: context_parallel_size=4 (--cp 4)"), last_line
    assert "2 query heads per TP rank, not divisible by 4" in last_line
    assert not (tmp_path / "o.json").exists()


@pytest.mark.slow
def test_bench_smoke_under_context_parallel(tmp_path):
    """`ps-bridge bench --smoke --cp 2` under torchrun (gloo, float32): the random-weight replicas are
    one model (broadcast from CP rank 0), so shared and unshared agree and both equal the float32
    twin; rank 0 alone reports; --max-tokens-per-gpu splits the unshared batch without running it."""
    out = tmp_path / "bench.json"
    argv = ["-m", "ps_bridge.tools.cli", "bench", "--smoke", "--cp", "2", "--no-progress", "--fp32-reference",
            "--models", "tiny-qwen2.5", "--grid", "24,8,4", "--max-tokens-per-gpu", "40", "--json", str(out)]
    proc = torchrun(2, argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ps-bridge bench on") == 1
    [row] = json.loads(out.read_text())["rows"]
    assert row["max_logprob_diff"] <= 1e-5 and row["shared_max_err_fp32"] <= 1e-5, row
    assert row["unshared"]["micro_batches"] == 2  # 128 unshared tokens = 64 per GPU > 40: split once
