"""Our models' sharded checkpoints are megatron's stock ones (docs/checkpoints.md): the same keys, global
shapes, offsets, fragmentations and replica ids as the stock modules of the same settings (megatron's
local spec), single rank here (`core`: both stacks); TP=2 / EP=2 / PP=2 (even and uneven) on two ranks (slow).
A grouped-expert checkpoint loads into megatron's SequentialMLP and back with equal values."""

import pytest
import torch

from ps_bridge.checkpoint import sharded_layout


def _load(path, monkeypatch=None, sequential=False, random_weights=False, **kw):
    from ps_bridge.compat.te_placeholder import import_megatron_bridge

    import_megatron_bridge()
    import ps_bridge.providers.qwen35 as qwen35
    from ps_bridge.tools.runtime import load_model, load_model_from_hf_config

    if not (sequential or random_weights):
        return load_model(path, **kw)
    from transformers import AutoConfig

    if not sequential:  # megatron's random initial weights
        return load_model_from_hf_config(AutoConfig.from_pretrained(path), **kw)
    # megatron's own SequentialMLP experts (the stock local spec's MoE experts), with megatron's random
    # initial weights: what the tests compare is saved from ours or loaded into it (Megatron-Bridge 0.5.0
    # maps Qwen3.5 MoE's HF experts onto grouped experts only, so it could not load them here)
    orig = qwen35.make_prefix_shared

    def with_sequential_mlp(provider, gdn_backend):
        orig(provider, gdn_backend)
        provider.moe_grouped_gemm = False

    monkeypatch.setattr(qwen35, "make_prefix_shared", with_sequential_mlp)
    loaded = load_model_from_hf_config(AutoConfig.from_pretrained(path), **kw)
    monkeypatch.setattr(qwen35, "make_prefix_shared", orig)
    return loaded


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    path = str(tmp_path_factory.mktemp("qwen35_moe_ckpt"))
    TINY_BUILDERS["qwen3.5-moe"](path, seed=0)
    return path


@pytest.mark.core  # both stacks (a few seconds each)
def test_grouped_experts_save_what_sequential_mlp_saves(moe_path, monkeypatch):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from ps_bridge.models.experts import GroupedMMExperts

    ours = _load(moe_path).model
    stock = _load(moe_path, monkeypatch, sequential=True).model
    assert isinstance(ours.decoder.layers[0].mlp.experts, GroupedMMExperts)
    assert isinstance(stock.decoder.layers[0].mlp.experts, SequentialMLP)
    a, b = sharded_layout(ours.sharded_state_dict()), sharded_layout(stock.sharded_state_dict())
    assert a == b
    # the expert axis: one (E, out, in) tensor per linear, one offset per expert, no per-expert key
    fc2 = [r for r in a if r[0] == "decoder.layers.0.mlp.experts.experts.linear_fc2.weight"]
    E = ours.config.num_moe_experts
    assert [r[3][0] for r in fc2] == list(range(E)) and {r[2][0] for r in fc2} == {E}
    assert not any("weight0" in r[0] for r in a)
    # a GDN layer's input norm under megatron's GDN key; full attention's under the local GPT key
    keys = {r[0] for r in a}
    kinds = ["gdn" if hasattr(layer.self_attention, "in_proj") else "attn" for layer in ours.decoder.layers]
    assert "gdn" in kinds and "attn" in kinds
    for i, kind in enumerate(kinds):
        linear = "in_proj" if kind == "gdn" else "linear_qkv"
        assert f"decoder.layers.{i}.self_attention.{linear}.layer_norm_weight" in keys
        assert f"decoder.layers.{i}.input_layernorm.weight" not in keys


@pytest.mark.core  # both stacks (a few seconds each)
@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "llama3"])
def test_dense_families_save_what_the_stock_local_spec_saves(tmp_path, family):
    """Qwen2.5, Qwen3 (q/k norms per head), Llama 3 (tied): our provider's model against megatron's local
    GPT layer spec on the same provider."""
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    TINY_BUILDERS[family](str(tmp_path), seed=0)
    loaded = _load(str(tmp_path))
    ours = sharded_layout(loaded.model.sharded_state_dict())
    stock = stock_local_spec_model(loaded.provider)
    # megatron's own core attention there, ours here
    assert not type(stock.decoder.layers[0].self_attention.core_attention).__module__.startswith("ps_bridge")
    assert type(loaded.model.decoder.layers[0].self_attention.core_attention).__module__.startswith("ps_bridge")
    assert ours == sharded_layout(stock.sharded_state_dict())
    assert any(r[0] == "decoder.layers.self_attention.linear_qkv.layer_norm_weight" for r in ours)
    if family == "qwen3":
        assert any(r[0] == "decoder.layers.self_attention.q_layernorm.weight" for r in ours)


@pytest.mark.core  # both stacks (a few seconds each)
def test_qwen3_moe_saves_what_megatrons_local_moe_spec_saves(tmp_path):
    """Qwen3 MoE with a dense layer among its MoE layers: our grouped experts and per-layer MLP kinds save
    what megatron's local decoder block spec (SequentialMLP experts, its `moe_layer_freq` pattern) saves."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    TINY_BUILDERS["qwen3-moe"](str(tmp_path), seed=0)
    loaded = _load(str(tmp_path))
    ours = sharded_layout(loaded.model.sharded_state_dict())
    provider = loaded.provider
    provider.moe_grouped_gemm = False
    block = get_gpt_decoder_block_spec(provider, use_transformer_engine=False, normalization=provider.normalization)
    provider.transformer_layer_spec = lambda config, vp_stage=None: block
    stock = provider.provide()
    assert ours == sharded_layout(stock.sharded_state_dict())
    keys = {r[0] for r in ours}
    assert "decoder.layers.1.mlp.linear_fc1.weight" in keys and "decoder.layers.1.mlp.router.weight" not in keys
    assert "decoder.layers.0.mlp.experts.experts.linear_fc1.weight" in keys


PADDED_DIVISOR = 96  # the tiny vocabulary (256) padded to 288 at TP=1, to 384 at TP=2 (multiples of 96 x TP)


def padded_vocab(monkeypatch, divisor=PADDED_DIVISOR):
    """Our runtime pads the vocabulary only where TP does not divide it: here always, as a provider with
    `should_pad_vocab` and `make_vocab_size_divisible_by` set does (megatron's embedding and output layer get
    `padded_vocab_size` rows; Megatron-Bridge loads the HF rows and zeros after them)."""
    # patched where the runtime looks it up (ps_bridge.tools.runtime imports it by name)
    import ps_bridge.tools.runtime as runtime

    orig = runtime.configure_provider

    def configure_provider(provider, settings):
        orig(provider, settings)
        provider.should_pad_vocab = True
        provider.make_vocab_size_divisible_by = divisor

    monkeypatch.setattr(runtime, "configure_provider", configure_provider)


def stock_local_spec_model(provider):
    """megatron's local GPT layer spec on our model's provider (its settings, vocabulary padding included).
    Under context parallelism its core attention (megatron's `DotProductAttention`, which asserts CP = 1:
    "only supported by TEDotProductAttention") is replaced by a parameterless one: megatron's has no
    parameters, buffers or state either (no checkpoint key: `test_a_padded_vocabulary...` checks), so every
    key, shape and replica id is still the local spec's own modules'."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=None, qk_layernorm=provider.qk_layernorm,
                                    normalization=provider.normalization)
    if provider.context_parallel_size > 1:
        from megatron.core.transformer.module import MegatronModule

        class StatelessCoreAttention(MegatronModule):
            def __init__(self, config, *args, **kwargs):
                super().__init__(config=config)

        spec.submodules.self_attention.submodules.core_attention = StatelessCoreAttention
    provider.transformer_layer_spec = spec
    return provider.provide()


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def vocab_rows(layout):
    """The embedding's and output layer's shards (key, kind, global shape, offset, fragmentation, replica id)."""
    return {key: [r[:6] for r in layout if r[0] == key] for key in VOCAB_KEYS}


@pytest.mark.core  # both stacks (a few seconds each)
def test_a_padded_vocabulary_saves_and_loads_what_the_stock_local_spec_does(tmp_path, monkeypatch):
    """A vocabulary padded to a multiple of `make_vocab_size_divisible_by` (256 -> 288 rows): the same keys,
    global shapes and sharding metadata as megatron's local spec of the same settings, and a dist-checkpoint
    round trip through the stock model and back keeps every value, the padded rows included."""
    from megatron.core import dist_checkpointing

    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    TINY_BUILDERS["qwen2.5"](str(tmp_path / "hf"), seed=0)
    padded_vocab(monkeypatch)
    # megatron's random weights: Megatron-Bridge pads the HF rows only when TP splits them (its
    # ColumnParallelMapping); at TP=1 its load of a padded model fails on the shapes (TP=2 loads: slow test)
    loaded = _load(str(tmp_path / "hf"), random_weights=True)
    assert (loaded.vocab_size, loaded.padded_vocab_size) == (256, 288)
    ours = loaded.model
    hidden = ours.config.hidden_size
    for key, module in zip(VOCAB_KEYS, (ours.embedding.word_embeddings, ours.output_layer)):
        assert module.weight.shape == (288, hidden), key
    stock = stock_local_spec_model(loaded.provider)
    a, b = sharded_layout(ours.sharded_state_dict()), sharded_layout(stock.sharded_state_dict())
    assert a == b
    # megatron's core attention holds no state (what the CP=2 comparison relies on)
    assert not any("core_attention" in r[0] for r in b)
    assert not list(stock.decoder.layers[0].self_attention.core_attention.state_dict(keep_vars=True))
    for key, rows in vocab_rows(a).items():
        assert rows == [(key, "tensor", (288, hidden), (0, 0), (1, 1), (0, 0, 0))], key
    with torch.no_grad():  # values neither model has from its initialisation, in the padded rows too
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for p in stock.parameters():
            p.zero_()
    assert ours.embedding.word_embeddings.weight[256:].abs().min() > 0
    saved = {n: p.detach().clone() for n, p in ours.named_parameters()}
    for name, src, dst in (("ours", ours, stock), ("stock", stock, ours)):
        (tmp_path / name).mkdir()
        dist_checkpointing.save(src.sharded_state_dict(), str(tmp_path / name))
        if dst is ours:
            with torch.no_grad():
                for p in ours.parameters():
                    p.zero_()
        dst.load_state_dict(dist_checkpointing.load(dst.sharded_state_dict(), str(tmp_path / name)))
        params = dict(dst.named_parameters())
        assert set(params) == set(saved)
        for n, p in params.items():
            assert torch.equal(p, saved[n]), (name, n)


def _keys_worker(*args):
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(Path(__file__).with_name("ckpt_keys_worker.py")), *map(str, args)],
        env=inherited, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0 and len(re.findall(r"RESULT ", proc.stdout)) == 2, proc.stderr[-4000:]


@pytest.mark.slow
def test_a_padded_vocabulary_at_tp2_saves_and_loads_what_the_stock_local_spec_does(tmp_path):
    """TP=2 on two ranks (gloo), the vocabulary padded to a multiple of 96 x 2 (256 -> 384): Megatron-Bridge
    loads the HF rows and zeros after them; every rank's layout equals megatron's local spec's (each rank
    192 rows of the (384, hidden) embedding and output layer); our model's checkpoint (perturbed, padded rows
    included) loads into the stock model with every value equal."""
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    TINY_BUILDERS["qwen2.5"](str(tmp_path / "hf"), seed=0)
    out = tmp_path / "padded"
    (tmp_path / "padded.dist").mkdir()
    _keys_worker(tmp_path / "hf", 2, 1, 1, out, "dense", 1, PADDED_DIVISOR)
    ranks = [torch.load(f"{out}.rank{r}") for r in range(2)]
    hidden = 64
    for rank, r in enumerate(ranks):
        assert r["padded_vocab_size"] == 384 and r["ours"] == r["stock"]
        for key, rows in vocab_rows(r["ours"]).items():
            assert rows == [(key, "tensor", (384, hidden), (192 * rank, 0), (2, 1), (0, 0, 0))], key
        assert set(r["saved"]) == set(r["loaded"])
        for n, p in r["saved"].items():
            assert torch.equal(p, r["loaded"][n]), (rank, n)
        assert r["saved"]["embedding.word_embeddings.weight"][256 - 192:].abs().min() > 0
    # the bridge's padding: rank 1 holds rows 192..383, of which 256..383 are zeros
    assert ranks[1]["embedding"][:256 - 192].any() and not ranks[1]["embedding"][256 - 192:].any()


@pytest.mark.slow
def test_context_parallel_checkpoints_save_and_load_what_the_stock_local_spec_does(tmp_path):
    """CP=2 on two ranks (gloo), Qwen2.5: megatron's local spec cannot be built under context parallelism (its
    `DotProductAttention` asserts CP = 1; TE's attention, absent here, is the only one with CP), so the stock
    side is the local spec with a parameterless core attention (megatron's has no state either). On every
    rank the layout equals it: every shard replicated over the CP group (the second rank's replica ids
    nonzero); our checkpoint (perturbed) loads into it with every value equal."""
    from ps_bridge.checkpoint import main_replica_shards
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    TINY_BUILDERS["qwen2.5"](str(tmp_path / "hf"), seed=0)
    out = tmp_path / "cp"
    (tmp_path / "cp.dist").mkdir()
    _keys_worker(tmp_path / "hf", 1, 1, 1, out, "dense", 2, 0)
    ranks = [torch.load(f"{out}.rank{r}") for r in range(2)]
    for r in ranks:
        assert r["ours"] == r["stock"]
        for n, p in r["saved"].items():
            assert torch.equal(p, r["loaded"][n]), n
    # CP ranks hold the same shards: the first writes them all, the second none
    assert {row[:5] for row in ranks[0]["ours"]} == {row[:5] for row in ranks[1]["ours"]}
    assert len(main_replica_shards(ranks[0]["ours"])) == len(ranks[0]["ours"])
    assert main_replica_shards(ranks[1]["ours"]) == []


@pytest.mark.core  # both stacks (a few seconds each)
def test_grouped_checkpoint_loads_into_sequential_mlp_and_back(moe_path, monkeypatch, tmp_path):
    from megatron.core import dist_checkpointing

    ours = _load(moe_path).model
    stock = _load(moe_path, monkeypatch, sequential=True).model
    with torch.no_grad():  # values neither model has from its initialisation
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for p in stock.parameters():
            p.zero_()
    (tmp_path / "grouped").mkdir()
    (tmp_path / "sequential").mkdir()
    dist_checkpointing.save(ours.sharded_state_dict(), str(tmp_path / "grouped"))
    stock.load_state_dict(dist_checkpointing.load(stock.sharded_state_dict(), str(tmp_path / "grouped")))
    ours_p, stock_p = dict(ours.named_parameters()), dict(stock.named_parameters())
    compared = 0
    for name, p in stock_p.items():
        if ".local_experts." in name:  # ...experts.local_experts.<i>.linear_fcK.weight -> ...experts.linear_fcK.weight<i>
            head, rest = name.split(".local_experts.")
            i, linear = rest.split(".", 1)
            other = ours_p[f"{head}.{linear}{i}"]
        else:
            other = ours_p[name]
        assert torch.equal(p, other), name
        compared += 1
    assert compared == len(ours_p)
    # and back, into a model whose weights were zeroed
    with torch.no_grad():
        saved = {n: p.detach().clone() for n, p in ours.named_parameters()}
        for p in ours.parameters():
            p.zero_()
    dist_checkpointing.save(stock.sharded_state_dict(), str(tmp_path / "sequential"))
    ours.load_state_dict(dist_checkpointing.load(ours.sharded_state_dict(), str(tmp_path / "sequential")))
    for name, p in ours.named_parameters():
        assert torch.equal(p, saved[name]), name
    # the experts still lie in one buffer (grouped_mm's no-copy view): loading copied into the parameters
    experts = ours.decoder.layers[0].mlp.experts.linear_fc1
    assert len(experts.spans(experts.weights())) == 1


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,pp,layers", [(1, 2, 1, 4), (2, 1, 1, 4), (1, 1, 2, 4), (1, 1, 2, 3)])
def test_parallel_layouts_save_what_megatron_saves(moe_path, tmp_path, tp, ep, pp, layers):
    """TP=2, EP=2, PP=2 (4 layers: 2 + 2; 3 layers: uneven, 2 + 1) on two CPU processes (gloo): on every
    rank our layout equals SequentialMLP's; the ranks' written shards never overlap and, together, cover
    every expert of every MoE layer (and, uneven, every layer once); megatron's dist_checkpointing.save of
    our model succeeds (it validates the sharding)."""
    from collections import Counter

    from ps_bridge.checkpoint import main_replica_shards

    if layers != 4:  # the same model with fewer layers (GDN, attention, GDN)
        from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

        moe_path = str(tmp_path / "hf")
        TINY_BUILDERS["qwen3.5-moe"](moe_path, seed=0, num_hidden_layers=layers,
                                     layer_types=["linear_attention", "full_attention", "linear_attention"][:layers])
    out = tmp_path / "layout"
    (tmp_path / "layout.dist").mkdir()
    _keys_worker(moe_path, tp, ep, pp, out)
    ranks = [torch.load(f"{out}.rank{r}") for r in range(2)]
    for r in ranks:
        assert r["ours"] == r["stock"]
    written = Counter(s for r in ranks for s in main_replica_shards(r["ours"]))
    assert max(written.values()) == 1  # no shard written twice (under EP: every expert its own offset)
    expert_offsets = {}
    for key, offset in written:
        if key.endswith("mlp.experts.experts.linear_fc2.weight"):
            expert_offsets.setdefault(key, set()).add(offset[0])
    E = 4  # the tiny Qwen3.5 MoE's experts
    assert expert_offsets and all(v == set(range(E)) for v in expert_offsets.values())
    # every layer's router saved once, under its global layer number (uneven stages: 2 + 1)
    routers = sorted(key for key, _ in written if key.endswith("mlp.router.weight"))
    assert routers == [f"decoder.layers.{i}.mlp.router.weight" for i in range(layers)]
    if pp == 2:
        stage_routers = [{row[0] for row in r["ours"] if row[0].endswith("mlp.router.weight")} for r in ranks]
        assert [len(s) for s in stage_routers] == [(layers + 1) // 2, layers // 2]
