"""Exact resume through verl 0.9.1's checkpoints at parallel layouts (docs/checkpoints.md): two CPU processes
(gloo) per run, fp32, `use_dist_checkpointing=True` (verl's default HF-safetensors model path: Qwen2.5 at TP=2 +
SP and PP=2); all slow (each run is a torch.distributed.run of
tests/ckpt_worker.py; a case costs two).

- at TP=2 + SP, PP=2 with an uneven split (2 + 1 layers), CP=2 (Qwen2.5) and EP=2 (Qwen3.5 MoE): ours resumes
  ours bit for bit (every rank's losses, grad norm, learning rate, parameters, and the whole model);
- the stock engine and ours resume each other at the same layout (Qwen2.5; not CP=2: the stock engine's CPU
  attention stand-in has no context parallelism); at EP=2 megatron's own expert
  module (SequentialMLP, the stock engine's; the stock Qwen3.5 engine does not run on a CPU) and ours
  (bit for bit but the grad norm, to rounding);
- `ps-bridge export` of a TP=2 + SP and an EP=2 checkpoint equals the bridge's export of the saved model;
- a checkpoint saved at TP=2 + SP resumes at PP=2 (megatron reshards the model and, with the
  non-distributed optimizer, its per-parameter optimizer state): the whole model (HF names, Megatron-Bridge's
  export) and the step equal the uninterrupted TP=2 run to fp32 rounding."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl 0.9.1 is not installed (requirements-verl*.txt)", allow_module_level=True)

import torch  # noqa: E402

from test_checkpoint_resume import assert_same_step  # noqa: E402

pytestmark = pytest.mark.slow
TESTS = os.path.dirname(os.path.abspath(__file__))
K = 2


def _ranks(*args, **env) -> None:
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    inherited.update(env)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(TESTS, "ckpt_worker.py"), *map(str, args)],
                          cwd=TESTS, env=inherited, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and len(re.findall(r"RESULT ", proc.stdout)) == 2, (
        proc.stdout[-2000:] + proc.stderr[-6000:])


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """(family, engine, layout[, dist]) -> (checkpoint dir, uninterrupted results by rank, HF checkpoint);
    dist: use_dist_checkpointing (1 unless given)."""
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS
    from ps_bridge.tools.verl_check.side_by_side import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("parallel_resume")
    made, hf = {}, {}

    def checkpoint(family):
        if family not in hf:
            hf[family] = str(root / family.replace(".", "_"))
            # Qwen2.5 with 3 layers: PP=2 splits them unevenly. Qwen3: a vocabulary TP=2 divides, as the
            # real one (151936) is: verl builds the model without Megatron-Bridge's vocabulary padding
            # (should_pad_vocab), for the stock engine and ours alike
            overrides = {"qwen2.5": {"num_hidden_layers": 3}, "qwen3": {"vocab_size": 256}, "qwen3-moe": {"vocab_size": 256}}
            model = TINY_BUILDERS[family](hf[family], seed=0, **overrides.get(family, {}))
            save_tiny_tokenizer(hf[family], model.config.vocab_size)
        return hf[family]

    def get(family, engine, layout, dist=1):
        key = (family, engine, layout, str(dist))
        if key not in made:
            name = "_".join(key).replace(".", "_")
            save, out = str(root / f"ckpt_{name}"), str(root / f"run_{name}.pt")
            _ranks("run", engine, checkpoint(family), save, out, K, dist, 0, layout)
            made[key] = (save, [torch.load(f"{out}.rank{r}") for r in range(2)], hf[family])
        return made[key]

    get.root = root
    return get


def _resume(parallel_runs, family, saver, loader, layout, load_layout=None, dist=1, **env):
    save, uninterrupted, hf = parallel_runs(family, saver, layout, dist)
    load_layout = load_layout or layout
    out = str(parallel_runs.root / f"resumed_{family}_{saver}_{loader}_{layout}_{load_layout}_{dist}.pt".replace(".", "_", 1))
    _ranks("resume", loader, hf, save, out, K, dist, 0, load_layout, **env)
    return uninterrupted, [torch.load(f"{out}.rank{r}") for r in range(2)]


LAYOUTS = [("qwen2.5", "tp2sp"), ("qwen2.5", "pp2f2l1"), ("qwen2.5", "cp2")]
# Qwen3.5 dense and MoE (4 layers: PP=2 split 3 + 1); their stock engine needs Transformer Engine, so only ours
QWEN35_LAYOUTS = [(family, layout) for family in ("qwen3.5", "qwen3.5-moe") for layout in ("tp2sp", "pp2f3l1", "cp2")]


# Qwen3 dense (2 layers: PP=2 splits 1 + 1) and Qwen3 MoE (4 layers, layer 1 dense: 2 + 2)
QWEN3_LAYOUTS = [("qwen3", "tp2sp"), ("qwen3", "pp2"), ("qwen3", "cp2"), ("qwen3-moe", "tp2sp"), ("qwen3-moe", "pp2"),
                 ("qwen3-moe", "ep2")]


@pytest.mark.parametrize("family,layout", LAYOUTS + QWEN35_LAYOUTS + [("qwen3.5-moe", "ep2")] + QWEN3_LAYOUTS)
def test_ours_resumes_ours_exactly_at_a_parallel_layout(parallel_runs, family, layout):
    """Under CP=2 and EP=2 the data-parallel group has two ranks, so megatron's fully parallel load (verl's
    load strategy) splits the reading between them and broadcasts the shards; every rank's step is bit-exact."""
    uninterrupted, resumed = _resume(parallel_runs, family, "ours", "ours", layout)
    for a, b in zip(uninterrupted, resumed):
        assert_same_step(a, b, exact=True)
        assert_same_step(a, b, exact=True, params="hf")  # the whole model (each rank holds half the experts)
    if layout == "ep2":
        _assert_every_expert_saved_once(parallel_runs(family, "ours", layout)[0])


@pytest.mark.parametrize("layout", ["tp2sp", "pp2f2l1"])
def test_ours_resumes_ours_exactly_through_hf_safetensors_at_a_parallel_layout(parallel_runs, layout):
    """verl's default model path (`use_dist_checkpointing=False`) at two ranks: Megatron-Bridge gathers the
    TP shards / PP stages into HF safetensors at the save and splits them again at the load (the optimizer,
    scheduler and RNG go through dist checkpointing, per rank): Qwen2.5, bit for bit on every rank and the
    whole model."""
    uninterrupted, resumed = _resume(parallel_runs, "qwen2.5", "ours", "ours", layout, dist=0)
    from ps_bridge.checkpoint import dist_checkpoint_keys, verl_tree_path

    save = parallel_runs("qwen2.5", "ours", layout, 0)[0]  # (verl 0.9.1's layout or 0.8.0's)
    assert any(n.endswith(".safetensors") for n in os.listdir(verl_tree_path(save, "huggingface")))
    model_tree = verl_tree_path(save, "model")  # no model tensor there (verl 0.8.0: the optimizer's tree too)
    if os.path.isfile(os.path.join(model_tree, ".metadata")):
        assert not [k for k in dist_checkpoint_keys(model_tree) if "decoder." in k and not k.startswith("optimizer.")]
    for a, b in zip(uninterrupted, resumed):
        assert_same_step(a, b, exact=True)
        assert_same_step(a, b, exact=True, params="hf")


def _assert_every_expert_saved_once(save_dir, num_experts=4):
    """The EP=2 checkpoint (the tiny Qwen3.5 MoE: 4 experts, 2 per rank): every expert linear's key has one
    chunk per expert on the expert axis, the two ranks' halves included, none twice."""
    import torch.distributed.checkpoint as dcp

    from ps_bridge.checkpoint import verl_tree_path

    # verl 0.9.1: model/dist_ckpt; 0.8.0: dist_ckpt (the model and the optimizer in one tree)
    metadata = dcp.FileSystemReader(verl_tree_path(save_dir, "model")).read_metadata()
    experts = {k: v for k, v in metadata.state_dict_metadata.items() if re.search(r"mlp\.experts\.experts\.linear_fc[12]\.weight$", k)}
    assert experts
    for key, meta in experts.items():  # (linear_fc1: each expert's gate and up halves, two chunks)
        offsets = [tuple(c.offsets) for c in meta.chunks]
        assert meta.size[0] == num_experts and {o[0] for o in offsets} == set(range(num_experts)), key
        assert all(c.sizes[0] == 1 for c in meta.chunks) and len(set(offsets)) == len(offsets), key
        assert sum(c.sizes.numel() for c in meta.chunks) == meta.size.numel(), key  # all of it, nothing twice


@pytest.mark.parametrize("saver,loader", [("ours", "sequential"), ("sequential", "ours")])
def test_grouped_and_sequential_mlp_experts_resume_each_other_under_expert_parallelism(parallel_runs, saver, loader):
    """EP=2: our grouped experts' checkpoint resumes megatron's own SequentialMLP experts (the stock expert
    module; the stock Qwen3.5 engine does not run on a CPU) and back: losses and every parameter bit for bit
    on every rank; the grad norm to rounding (it sums the parameters' squares in each module's parameter
    order, which differs between the two expert modules: 7e-10 relative seen)."""
    uninterrupted, resumed = _resume(parallel_runs, "qwen3.5-moe", saver, loader, "ep2")
    for a, b in zip(uninterrupted, resumed):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-7)
        assert_same_step(a, dict(b, grad_norm=a["grad_norm"]), exact=True)


# not CP=2: the stock engine's CPU attention (ps_bridge/tools/verl_check/side_by_side.py, a stand-in for TE's / flash's)
# has no context parallelism (its run fails on the CP shard's sequence lengths)
@pytest.mark.parametrize("saver,loader", [("ours", "stock"), ("stock", "ours")])
@pytest.mark.parametrize("family,layout", [fl for fl in LAYOUTS if fl[1] != "cp2"] + [("qwen3", "tp2sp")])
def test_the_stock_engine_and_ours_resume_each_other_at_a_parallel_layout(parallel_runs, family, layout, saver, loader):
    uninterrupted, resumed = _resume(parallel_runs, family, saver, loader, layout)
    for a, b in zip(uninterrupted, resumed):  # stock vs ours: fp32 rounding
        assert_same_step(a, b, exact=False)


def test_our_context_parallel_checkpoint_loads_into_the_stock_engine_without_it(parallel_runs):
    """Stock <-> ours at CP=2 cannot run here (the stock engine's CPU attention, and megatron's local one,
    have no context parallelism; TE's has): our engine's CP=2 checkpoint (`use_dist_checkpointing=True`) is
    loaded by the stock engine in one process (CP=1; megatron drops the CP replicas): the loaded model equals
    the saved one bit for bit, the learning rate too, and the step that follows the uninterrupted CP=2 run's
    to fp32 rounding (another layout: another summation order). The keys at CP=2 against megatron's local
    spec: tests/test_checkpoint_keys.py."""
    from test_checkpoint_resume import _worker

    save, uninterrupted, hf = parallel_runs("qwen2.5", "ours", "cp2")
    out = str(parallel_runs.root / "resumed_cp2_in_stock.pt")
    _worker("resume", "stock", hf, save, out, K, 1, 0)
    resumed = torch.load(out)
    for a in uninterrupted:  # (each CP rank holds the whole model)
        assert set(a["at_checkpoint"]) == set(resumed["at_checkpoint"])
        for n, p in a["at_checkpoint"].items():
            assert torch.equal(p, resumed["at_checkpoint"][n]), n
        assert a["lr"] == resumed["lr"]
        assert a["losses"] == pytest.approx(resumed["losses"], rel=1e-5, abs=1e-6)  # (every CP rank has them all)
        for n, p in a["params"].items():
            assert (p - resumed["params"][n]).abs().max().item() < 1e-5, n
    norms = [a["grad_norm"] for a in uninterrupted if a["grad_norm"] is not None]  # (reported where rows are output)
    assert norms and all(g == pytest.approx(resumed["grad_norm"], rel=1e-5) for g in norms)


def test_a_tensor_parallel_checkpoint_resumes_at_another_layout(parallel_runs):
    """Saved at TP=2 + SP, resumed at PP=2 (uneven): megatron's dist checkpointing reshards the model and
    the (non-distributed) optimizer's per-parameter state. The whole model under HF names and the learning
    rate equal the uninterrupted run's, and the step's loss to fp32 rounding (on the last stage). verl's RNG
    states (`extra`) are one object per (PP, TP) rank and do not reshard: model and optimizer only (no
    dropout here)."""
    uninterrupted, resumed = _resume(parallel_runs, "qwen2.5", "ours", "ours", "tp2sp", "pp2f2l1",
                                     PS_CKPT_LOAD_CONTENTS="model,optimizer")
    for a, b in zip(uninterrupted, resumed):
        assert a["lr"] == b["lr"] and set(a["hf"]) == set(b["hf"])
        for n, t in a["hf"].items():
            assert (t - b["hf"][n]).abs().max().item() < 1e-5, n
    losses = [b["losses"] for b in resumed if b["losses"]]
    assert len(losses) == 1 and losses[0] == pytest.approx(uninterrupted[0]["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("family,layout", [("qwen2.5", "tp2sp"), ("qwen3.5-moe", "ep2")])
def test_export_of_a_parallel_checkpoint_equals_the_bridge_export(parallel_runs, tmp_path, family, layout):
    """`ps-bridge export` (one process) of our engine's checkpoint saved at TP=2 + SP or EP=2: megatron
    reshards it on the load, and every tensor equals Megatron-Bridge's export of the saved model, gathered
    over the two ranks at the save (`ps-bridge logprobs` on an export: tests/test_checkpoint_export.py)."""
    from safetensors.torch import load_file

    from ps_bridge.tools.cli import main

    save, uninterrupted, hf = parallel_runs(family, "ours", layout)
    out = str(tmp_path / "exported")
    # verl 0.9.1 saves no HF config with use_dist_checkpointing=True (unless save_contents has 'hf_model')
    assert main(["export", "--checkpoint", save, "--out", out]) == 2
    assert main(["export", "--checkpoint", save, "--out", out, "--hf-config", hf]) == 0
    exported = load_file(os.path.join(out, "model.safetensors"))
    saved = uninterrupted[0]["saved_hf"]
    assert saved and set(exported) == set(saved)
    for name, t in saved.items():
        assert torch.equal(exported[name], t), name
