"""Exact resume through verl's checkpoints (docs/checkpoints.md), CPU, fp32, one rank: verl 0.9.1 (its v2
layout); the default case (`core`) on verl 0.8.0 too (its older layout).

Each run is its own process (tests/ckpt_worker.py): train K steps, save, train one more step (the
uninterrupted run); a NEW process builds an engine, loads the checkpoint and trains that one step. Its
losses, grad norm, learning rate and every parameter equal the uninterrupted run's: bit for bit when
the same engine resumes, to fp32 rounding when the other engine does (prefix sharing changes the
rounding, not the values). Model weights through verl's default HF safetensors (`dist=0`) or megatron's
dist checkpointing (`use_dist_checkpointing=True`, `dist=1`). A truncated or missing shard is named
before megatron or safetensors read it. Multi-rank layouts: tests/test_checkpoint_parallel.py."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

import torch  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
K = 2  # steps before the save


def _worker(*args, fails: bool = False):
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "ckpt_worker.py"), *map(str, args)], cwd=TESTS,
                          capture_output=True, text=True, timeout=900)
    if fails:
        assert proc.returncode != 0 and "RESULT" not in proc.stdout
    else:
        assert proc.returncode == 0 and "RESULT" in proc.stdout, (proc.stdout[-3000:] + proc.stderr[-5000:])
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(family, engine, dist[, distopt]) -> (checkpoint dir, uninterrupted result, HF checkpoint), each made once."""
    from ps_bridge.tools.verl_check.side_by_side import tiny_checkpoint

    root = tmp_path_factory.mktemp("resume")
    made, hf = {}, {}

    def get(family, engine, dist, distopt=0):
        key = (family, engine, dist, distopt)
        if key not in made:
            if family not in hf:
                hf[family] = str(root / family.replace(".", "_"))
                tiny_checkpoint(hf[family], family)
            name = "_".join(map(str, key)).replace(".", "_")
            save, out = str(root / f"ckpt_{name}"), str(root / f"run_{name}.pt")
            _worker("run", engine, hf[family], save, out, K, dist, distopt)
            made[key] = (save, torch.load(out), hf[family])
        return made[key]

    get.root = root
    return get


def _resume(runs, family, saver, loader, dist):
    save, uninterrupted, hf = runs(family, saver, dist)
    out = str(runs.root / f"resumed_{family}_{saver}_{loader}_{dist}.pt".replace(".", "_", 1))
    _worker("resume", loader, hf, save, out, K, dist, 0)
    return uninterrupted, torch.load(out)


def grouped_name(name: str) -> str:
    """megatron's SequentialMLP parameter name -> our grouped experts' (`...local_experts.<i>.linear_fcK.weight`
    -> `...linear_fcK.weight<i>`); other names unchanged."""
    if ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.")
    i, linear = rest.split(".", 1)
    return f"{head}.{linear}{i}"


def assert_same_step(a, b, exact: bool, params: str = "params"):
    """The resumed step `b` equals the uninterrupted `a`: losses, grad norm, learning rate, every parameter
    (`params`: this rank's, named alike up to `grouped_name`; or "hf": the whole model under HF names)."""
    assert a["lr"] == b["lr"]
    pa = {grouped_name(n): p for n, p in a[params].items()}
    pb = {grouped_name(n): p for n, p in b[params].items()}
    assert set(pa) == set(pb) and pa
    if exact:
        assert a["losses"] == b["losses"] and a["grad_norm"] == b["grad_norm"]
        for n, p in pa.items():
            assert torch.equal(p, pb[n]), n
        return
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5, abs=1e-6)
    assert (a["grad_norm"] is None) == (b["grad_norm"] is None)  # (reported on the ranks that output rows)
    assert a["grad_norm"] is None or a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for n, p in pa.items():
        assert (p - pb[n]).abs().max().item() < 1e-5, n


@pytest.mark.parametrize("family,dist", [
    # verl's default: the model as HF safetensors through the bridge; both stacks (verl 0.9.1 and 0.8.0)
    pytest.param("qwen2.5", 0, marks=pytest.mark.core),
    pytest.param("qwen2.5", 1, marks=pytest.mark.slow),
    pytest.param("qwen3.5", 1, marks=pytest.mark.slow),
    pytest.param("qwen3.5", 0, marks=pytest.mark.slow),
    pytest.param("qwen3.5-moe", 1, marks=pytest.mark.slow),
    pytest.param("qwen3.5-moe", 0, marks=pytest.mark.slow),
    pytest.param("qwen3", 1),
    pytest.param("qwen3", 0, marks=pytest.mark.slow),
    pytest.param("qwen3-moe", 1, marks=pytest.mark.slow),
    pytest.param("qwen3-moe", 0, marks=pytest.mark.slow),
])
def test_ours_resumes_ours_exactly(runs, family, dist):
    """Bit for bit, except Qwen3.5 through HF safetensors: Megatron-Bridge converts its zero-centred GDN output
    norm to HF's plain scale and back (w + 1, then - 1, in fp32), which rounds (observed on Qwen3.5 MoE: the
    resumed step's losses and grad norm bit-equal, the out-norm weights equal to fp32 rounding only)."""
    uninterrupted, resumed = _resume(runs, family, "ours", "ours", dist)
    assert_same_step(uninterrupted, resumed, exact=dist == 1 or family == "qwen2.5")
    # verl's extra/: the RNG states the resumed process had scrambled before the load are the saved ones
    assert resumed["rng"] == uninterrupted["rng"]


@pytest.mark.slow
@pytest.mark.parametrize("saver,loader", [("ours", "stock"), ("stock", "ours")])
@pytest.mark.parametrize("dist", [0, 1])
@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_the_stock_engine_and_ours_resume_each_other(runs, saver, loader, dist, family):
    """Qwen2.5 and Qwen3 dense: the stock Qwen3.5 model does not run on a CPU (TE-only hybrid spec, fla's
    Triton GDN kernels), nor Qwen3 MoE's stock alltoall dispatcher (CUDA streams). The stock engine gets
    the fixes of verl's checkpoint manager our engine carries."""
    uninterrupted, resumed = _resume(runs, family, saver, loader, dist)
    assert_same_step(uninterrupted, resumed, exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("saver,loader", [("ours", "sequential"), ("sequential", "ours")])
def test_moe_resumes_across_grouped_and_sequential_mlp_experts(runs, saver, loader):
    """Qwen3.5 MoE: a checkpoint of our grouped experts resumes megatron's own SequentialMLP experts (the
    stock expert module; the stock Qwen3.5 engine does not run on a CPU) and back, exactly: same keys,
    the optimizer state follows each expert's checkpoint key."""
    uninterrupted, resumed = _resume(runs, "qwen3.5-moe", saver, loader, 1)
    assert_same_step(uninterrupted, resumed, exact=True)


@pytest.mark.slow
def test_the_distributed_optimizer_trains_and_saves_and_its_load_is_refused_here(runs):
    """megatron's distributed optimizer (verl's default) trains and saves on a CPU (with the CPU shims of
    ps_bridge.compat.verl_on_cpu) and computes the non-distributed run's step; megatron-core loads its state
    only on Transformer Engine's / Apex's Adam, absent here: our engine refuses the load naming
    use_distributed_optimizer (the GPU check: tools/gpu_ckpt.sh)."""
    from ps_bridge.checkpoint import LAYOUT_RECORD, optimizer_sharding_type, verl_tree_path

    save, distributed, hf = runs("qwen2.5", "ours", 1, 1)
    _, plain, _ = runs("qwen2.5", "ours", 1)
    assert distributed["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-7)
    assert distributed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    optimizer_tree = verl_tree_path(save, "optimizer")  # verl 0.9.1: optimizer/dist_ckpt; 0.8.0: dist_ckpt
    assert optimizer_sharding_type(optimizer_tree) == "dp_reshardable"
    assert os.path.isfile(os.path.join(os.path.dirname(optimizer_tree), LAYOUT_RECORD))
    proc = _worker("resume", "ours", hf, save, str(runs.root / "refused.pt"), K, 1, 1, fails=True)
    assert "InexactLoadError" in proc.stderr and "use_distributed_optimizer=False" in proc.stderr


@pytest.mark.core  # (the default case's checkpoint: no run of its own)
def test_a_truncated_or_missing_shard_is_named(runs, tmp_path):
    from ps_bridge.checkpoint import CheckpointFileError, check_checkpoint_files, verl_tree_path

    save, _, _ = runs("qwen2.5", "ours", 0)
    check_checkpoint_files(save)  # the saved checkpoint is whole
    shards = {}  # a shard of each tree the load reads (verl 0.8.0: one tree holds the optimizer and extra)
    for tree in ("optimizer", "extra", "huggingface"):
        d = verl_tree_path(save, tree)
        name = "model.safetensors" if tree == "huggingface" else sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]
        shards.setdefault(os.path.relpath(os.path.join(d, name), save), tree)
    assert len(shards) >= 2
    for rel, tree in shards.items():
        copy = str(tmp_path / tree)
        shutil.copytree(save, copy)
        shard = os.path.join(copy, rel)
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
        with pytest.raises(CheckpointFileError, match=f"{shard} is truncated"):
            check_checkpoint_files(copy)
        os.remove(shard)
        with pytest.raises(CheckpointFileError, match=f"{shard} is missing"):
            check_checkpoint_files(copy, [tree])  # the trees the engine's load reads
    metadata = os.path.join(verl_tree_path(str(tmp_path / "optimizer"), "optimizer"), ".metadata")
    os.remove(metadata)
    with pytest.raises(CheckpointFileError, match="metadata"):
        check_checkpoint_files(str(tmp_path / "optimizer"))


@pytest.mark.parametrize("dist", [
    pytest.param(0, marks=pytest.mark.core),  # verl's default: the model's HF safetensors; both stacks
    pytest.param(1, marks=pytest.mark.slow),  # use_dist_checkpointing=True: the model's dist_ckpt shards
])
def test_the_engine_load_names_a_truncated_or_missing_model_shard(runs, tmp_path, capsys, dist):
    """Our engine's `load_checkpoint` (one new process, tests/ckpt_worker.py `refuse`) of a checkpoint it saved,
    with one model file truncated to half, and (a second copy) deleted: a `CheckpointFileError` whose one-line
    message names the file and what to do, with no exception chained under it (no second traceback); with
    `use_dist_checkpointing=True`, `ps-bridge export` of the truncated copy prints that message, no traceback."""
    import json

    from ps_bridge.checkpoint import verl_tree_path

    save, _, hf = runs("qwen2.5", "ours", dist)
    tree = "model" if dist else "huggingface"
    suffix = ".distcp" if dist else ".safetensors"
    name = sorted(n for n in os.listdir(verl_tree_path(save, tree)) if n.endswith(suffix))[0]
    damaged = []
    for how in ("truncated", "missing"):
        copy = str(tmp_path / how)
        shutil.copytree(save, copy)
        shard = os.path.join(verl_tree_path(copy, tree), name)
        if how == "truncated":
            with open(shard, "r+b") as f:
                f.truncate(os.path.getsize(shard) // 2)
        else:
            os.remove(shard)
        damaged.append((how, shard, copy))
    out = str(tmp_path / "refusals.json")
    _worker("refuse", "ours", hf, ",".join(d[2] for d in damaged), out, K, dist, 0)
    with open(out) as f:
        seen = json.load(f)
    for (how, shard, _), err in zip(damaged, seen):
        assert err is not None and err["type"] == "CheckpointFileError" and not err["chained"], (how, err)
        message = err["message"]
        assert f"{shard} is {how}" in message and "\n" not in message, message
        assert message.endswith("save it again or resume from an earlier one"), message
    if dist:
        from ps_bridge.tools.cli import main

        capsys.readouterr()
        assert main(["export", "--checkpoint", damaged[0][2], "--out", str(tmp_path / "o"), "--hf-config", hf]) == 2
        printed = capsys.readouterr()
        assert f"{damaged[0][1]} is truncated" in printed.err + printed.out
        assert "Traceback" not in printed.err + printed.out
