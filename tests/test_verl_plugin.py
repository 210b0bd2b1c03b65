"""The plugin as verl loads it (`external_lib=ps_bridge.verl`), its refusals, and weight export."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

import torch  # noqa: E402

import ps_bridge.tools.verl_check.side_by_side as vt  # noqa: E402

vt.prepare_side_by_side()

from verl.workers.engine.base import EngineRegistry  # noqa: E402

from ps_bridge.compat import verl as verl_compat  # noqa: E402
from ps_bridge.verl.engine import PrefixSharedMegatronEngine, npu_engine_class  # noqa: E402

# verl 0.8.0's loss gives megatron no token count: the engine refuses `calculate_per_token_loss=True` there
PER_TOKEN_LOSS = pytest.mark.skipif(
    not verl_compat.loss_returns_token_count(),
    reason=f"verl {verl_compat.verl_version()} has no per-token loss: refused (test_per_token_loss_refused_...)")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    vt.tiny_checkpoint(path, "qwen2.5")
    return path


@pytest.mark.core
def test_engine_registered_under_vendor_keys(monkeypatch):
    """verl 0.9.1 looks engines up by (device, vendor), 0.8.0 by device (the CPU runs take the
    device from `VERL_ENGINE_DEVICE` on both)."""
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "nvidia")
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is PrefixSharedMegatronEngine
    npu = npu_engine_class()
    assert npu is not None, "verl's MindSpeed engine module should import (MindSpeed itself is optional)"
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "npu")
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "huawei")
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is npu
    # the value-model engine stays verl's
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    assert EngineRegistry.get_engine_cls("value_model", "megatron").__name__ == "MegatronEngineWithValueHead"


@pytest.mark.core
def test_fused_kernels_refused(qwen2_dir):
    with pytest.raises(NotImplementedError, match="use_fused_kernels=False"):
        vt.build_engine(PrefixSharedMegatronEngine, qwen2_dir, use_fused_kernels=True)


@pytest.mark.core
def test_vanilla_mbridge_refused(qwen2_dir):
    with pytest.raises(ValueError, match="vanilla_mbridge=False"):
        vt.build_engine(PrefixSharedMegatronEngine, qwen2_dir, vanilla_mbridge=True)


@pytest.mark.core
def test_trees_accepted_under_model_parallelism():
    """`PS_BRIDGE_TREE=1` under TP, PP, CP and EP: accepted (the engine runs trees there: the tree cases
    below); what the engine refuses of a parallel layout is `ParallelSettings.check_supported`'s, with
    or without trees (e.g. dynamic context parallelism, named with its fix)."""
    from types import SimpleNamespace

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.verl.engine import PrefixSharingEngineMixin

    engine = PrefixSharingEngineMixin()
    engine.prefix_sharing_config = PrefixSharingConfig(enabled=True, tree=True)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        engine.engine_config = SimpleNamespace(use_fused_kernels=False, **{name: 2})
        engine._check_parallel_layout()
    engine.engine_config = SimpleNamespace(use_fused_kernels=False, context_parallel_size=2, dynamic_context_parallel=True)
    with pytest.raises(ValueError, match="dynamic_context_parallel=True; leave it off"):
        engine._check_parallel_layout()


@pytest.mark.core
@pytest.mark.skipif(verl_compat.loss_returns_token_count(),
                    reason="this verl returns megatron's per-token loss: run by the cp2_per_token layout test")
def test_per_token_loss_refused_where_verl_returns_no_token_count(qwen2_dir):
    """verl 0.8.0's loss returns (loss, output): with `calculate_per_token_loss=True` megatron would sum
    the gradients over data-parallel ranks and divide by no token count. Refused, naming the setting."""
    with pytest.raises(NotImplementedError, match="calculate_per_token_loss=False"):
        vt.build_engine(PrefixSharedMegatronEngine, qwen2_dir, forward_only=False,
                        overrides=dict(calculate_per_token_loss=True))


def test_weight_export_equals_stock_provider(qwen2_dir):
    """What verl streams to the rollout engine: same HF names, shapes and values as the stock
    provider's export (and as the checkpoint)."""
    from safetensors.torch import load_file

    stock = vt.build_stock_engine(qwen2_dir)
    ours = vt.build_engine(PrefixSharedMegatronEngine, qwen2_dir)
    with vt.engine_call_on_cpu():
        exported_stock = {n: t.detach().clone() for n, t in stock.get_per_tensor_param()[0]}
        exported_ours = {n: t.detach().clone() for n, t in ours.get_per_tensor_param()[0]}
    checkpoint = load_file(os.path.join(qwen2_dir, "model.safetensors"))
    assert sorted(exported_ours) == sorted(exported_stock) == sorted(checkpoint)
    for name, tensor in exported_ours.items():
        assert tensor.shape == exported_stock[name].shape
        assert torch.equal(tensor, exported_stock[name]), name
        assert torch.equal(tensor, checkpoint[name]), name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


END_TO_END = textwrap.dedent(
    """
    import json, sys
    from ps_bridge.compat.verl_on_cpu import prepare_cpu_process
    prepare_cpu_process()
    from ps_bridge.parallel.groups import init_parallel
    init_parallel()
    from verl.workers.config import HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    ckpt = sys.argv[1]
    HFModelConfig(path=ckpt, external_lib="ps_bridge.verl")  # where verl imports external_lib
    cls = EngineRegistry.get_engine_cls("language_model", "megatron")
    result = {"engine": cls.__name__}
    if cls.__name__ == "PrefixSharedMegatronEngine":
        from ps_bridge.tools.tiny_checkpoints import grpo_like_samples
        import ps_bridge.tools.verl_check.side_by_side as vt
        engine = vt.build_engine(cls, ckpt)
        result["model"] = type(engine._unwrapped_model()).__name__
        result["provider"] = type(engine.provider).__name__
        td = vt.grpo_micro_batch(grpo_like_samples(256, num_prompts=2, n=4, shuffle=False), micro_batch_size=8)
        with vt.engine_call_on_cpu(), engine.eval_mode():
            out = engine.infer_batch(td)["model_output"]
        result["rows"] = len(out["log_probs"].unbind())
    print("RESULT " + json.dumps(result))
    """
)


@pytest.mark.core
@pytest.mark.parametrize("enabled", ["1", "0"])
def test_external_lib_switches_engine_and_model(qwen2_dir, enabled):
    """A fresh process does what a verl worker does: HFModelConfig imports external_lib, the
    engine registry picks the engine, the engine builds its model through Megatron-Bridge."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env = dict(inherited, MASTER_PORT=str(free_port()), ENABLE_PREFIX_SHARING=enabled, PS_BRIDGE_PROVIDER="qwen2.5",
               VERL_ENGINE_DEVICE="cuda", VERL_ENGINE_VENDOR="nvidia")
    proc = subprocess.run([sys.executable, "-c", END_TO_END, qwen2_dir], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    log = proc.stdout + proc.stderr
    if enabled == "1":
        assert result == {"engine": "PrefixSharedMegatronEngine", "model": "PrefixSharedGPTModel",
                          "provider": "PrefixSharedQwen2Provider", "rows": 8}
        assert "[PS][prepare] config.enable_prefix_sharing=True" in log
        assert "PATH 6: sharing detected" in log and "packed_batch_layout" in log
        assert "[PS][attention]" in log and "enter prefix-sharing path" in log
    else:
        assert result == {"engine": "MegatronEngineWithLMHead"}
        assert "config.enable_prefix_sharing=False" in log


def _spine_has_sequence_parallel_norms() -> bool:
    from ps_bridge.models import specs

    return hasattr(specs, "with_sequence_parallel_norms")


@pytest.mark.parametrize("sequence_parallel", [
    pytest.param(False, marks=pytest.mark.slow),  # TP without SP: slow; the default SP case runs TP=2 too
    pytest.param(True, marks=[pytest.mark.core, pytest.mark.skipif(
        not _spine_has_sequence_parallel_norms(),
        reason="the prefix-aware layer spec on this branch has no sequence-parallel norms (main has them)")]),
])
def test_tensor_parallel_two_ranks_match_stock_engine(qwen2_dir, sequence_parallel):
    """TP=2 on two CPU processes (gloo): vocab-parallel log-probs / entropy on the packed logits,
    segments padded to the TP size, and the gradient shards, against the stock engine at TP=2
    (with sequence parallelism: the same, for both engines)."""
    _tensor_parallel_comparison(qwen2_dir, ["sequence_parallel"] if sequence_parallel else [])


def test_tree_tensor_parallel_two_ranks_match_stock_engine(qwen2_dir):
    """Prefix trees (`PS_BRIDGE_TREE=1`, threshold 0) at TP=2 + SP on two CPU processes (gloo): a system
    prompt shared by 4 prompts of 3 responses and a 4-turn chain, dynamic micro-batches; our engine's
    log-probs (each row's unlabelled last one left out), entropy and gradient shards equal the stock
    engine's at TP=2 + SP, on trees deeper than one level."""
    for r in _tensor_parallel_comparison(qwen2_dir, ["sequence_parallel", "tree"], timeout=600):
        assert r["thd_depths"] and max(r["thd_depths"]) >= 2, r


def _tensor_parallel_comparison(qwen2_dir: str, flags: list, timeout: int = 300) -> list:
    """`verl_harness.py CKPT *FLAGS` on two ranks: every difference its ranks report is below 1e-5."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(Path(__file__).with_name("verl_harness.py")), qwen2_dir, *flags],
        env=inherited, capture_output=True, text=True, timeout=timeout,
    )
    # the two ranks share stdout, so their lines can interleave: pick the JSON objects out
    results = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)]
    assert proc.returncode == 0 and len(results) == 2, proc.stderr[-3000:]
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["tp_size"] == 2 for r in results)
    for r in results:
        print(r)
        assert all(v < 1e-5 for k, v in r.items() if k not in ("rank", "tp_size") and not k.endswith("_depths")), r
    return results


def _harness_ranks(args: list, nproc: int, out: Path, timeout: int = 600) -> list:
    """`verl_harness.py *ARGS` on `nproc` CPU processes (the harness saves to `OUT.rank<r>`, `out` is
    its OUT): each rank's RESULT line and what every rank saved, by rank."""
    harness = str(Path(__file__).with_name("verl_harness.py"))
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", harness,
         *[str(a) for a in args]],
        env=inherited, capture_output=True, text=True, timeout=timeout,
    )
    results = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)]
    assert proc.returncode == 0 and len(results) == nproc, proc.stderr[-3000:]
    return sorted(results, key=lambda r: r["rank"]), [torch.load(f"{out}.rank{r}") for r in range(nproc)]


# ---- parallel layouts with context parallelism, against our engine at CP=1 unshared ------------------
#
# verl's stock engine is not the reference here: it has no context parallelism without Transformer
# Engine, which does not run on a CPU. The reference is our own engine on one process (TP = PP = CP =
# DP = 1), prefix sharing off: one sequence per sample, the unshared computation, on the same 16
# samples, advantages and old / ref log-probs.

# name: (processes, tp, pp, cp, sequence parallel, megatron's per-token-loss regime, default suite)
LAYOUTS = {
    "cp2": (2, 1, 1, 2, False, False, True),
    "cp2_per_token": (2, 1, 1, 2, False, True, True),
    "cp2_dp2_per_token": (4, 1, 1, 2, False, True, False),
    "cp2_dp2": (4, 1, 1, 2, False, False, False),
    "cp2_tp2_sp": (4, 2, 1, 2, True, False, False),
    "cp2_pp2": (4, 1, 2, 2, False, False, False),
}
LAYOUT_TOL = 1e-5


def _layout(ckpt: str, nproc: int, tp: int, pp: int, cp: int, sp: bool, per_token: bool, out: Path, tree: bool = False,
            timeout: int = 600):
    return _harness_ranks(["layout", ckpt, tp, pp, cp, int(sp), int(per_token), out] + (["tree"] if tree else []),
                          nproc, out, timeout)


@pytest.fixture(scope="module")
def engine_at_cp1_unshared(qwen2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("layout_ref") / "ref"
    _, (ref,) = _layout(qwen2_dir, 1, 1, 1, 1, False, False, out)
    assert ref["rows"] is not None and ref["samples"] == list(range(16))
    return ref


def _relative_grad_diff(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        assert g.abs().max() > 0, name  # every parameter takes part
    return max(((got[n] - g).abs().max() / g.abs().max()).item() for n, g in ref.items())


def _layout_marks(name: str, config: tuple) -> list:
    """slow unless in the default suite; the per-token layouts only where verl has a per-token loss;
    `cp2` in the oldest stack's core subset."""
    marks = [] if config[-1] else [pytest.mark.slow]
    if config[5]:
        marks.append(PER_TOKEN_LOSS)
    if name == "cp2":
        marks.append(pytest.mark.core)
    return marks


@pytest.mark.parametrize("name", [pytest.param(n, marks=_layout_marks(n, c)) for n, c in LAYOUTS.items()])
def test_parallel_layout_with_context_parallel_matches_engine_at_cp1(qwen2_dir, engine_at_cp1_unshared, tmp_path, name):
    """Our engine with prefix sharing at a layout with CP=2 (CPU processes, gloo, fp32), each
    data-parallel rank its own whole groups, against our engine at CP=1 unshared on one process:
    `infer_batch` log-probs and entropy (temperature 0.7) of each rank's samples, and for verl's
    `loss_agg_mode` token-mean and seq-mean-token-mean the HF-named gradient of every parameter of
    verl's own `ppo_loss` after megatron's DDP reduction. The normalisation is verl's: the loss is
    over the whole mini-batch (token-mean: `batch_num_tokens` summed over DP; seq-mean:
    `global_batch_size` samples) times verl's `dp_size`, megatron's schedule scales it by the CP size
    and its DDP averages over data-parallel-with-CP, so the gradient is the single-process one; in the
    per-token regime (`calculate_per_token_loss`) verl returns (loss x tokens, tokens / CP) and
    megatron sums, then divides by the tokens summed over data-parallel-with-CP (with verl's own
    count of a CP rank's tokens, `n // cp`, this batch's gradients come out 339 / 338 too large:
    `PrefixSharingEngineMixin.postprocess_micro_batch_func`). Negative control: without megatron's
    gradient reduction (`finalize_model_grads`) the gradients differ."""
    nproc, tp, pp, cp, sp, per_token, _ = LAYOUTS[name]
    results, ranks = _layout(qwen2_dir, nproc, tp, pp, cp, sp, per_token, tmp_path / name)
    _check_layout_ranks(name, results, ranks, engine_at_cp1_unshared, (tp, pp, cp, nproc // (tp * pp * cp)))


def _check_layout_ranks(name: str, results: list, ranks: list, ref: dict, sizes: tuple, tree: bool = False) -> None:
    """Each rank of a layout run against the single-process unshared reference: sizes (TP, PP, CP, DP),
    rows from position P - 1 on, every reduced gradient; the negative control (gradients without
    megatron's reduction differ) where a reduction over ranks takes place (DP or CP > 1). With `tree`
    (dynamic micro-batches, formed differently by the reference) each row's unlabelled last log-prob
    is left out, and every rank must have run trees deeper than one level."""
    tp, pp, cp, dp = sizes
    assert all((r["tp_size"], r["pp_size"], r["cp_size"], r["dp_size"]) == sizes for r in results), results
    if tree:
        assert all(r["depths"] and max(r["depths"]) >= 2 for r in results), [r["depths"] for r in results]
    seen, worst = set(), {"rows": 0.0, "grads": 0.0}
    for rank, got in enumerate(ranks):
        if dp > 1:  # each DP rank a part of the batch, whole groups
            assert 0 < len(got["samples"]) < 16 and len({i // 4 for i in got["samples"]}) * 4 == len(got["samples"])
        if got["rows"] is not None:  # the last pipeline stage: every TP / CP rank hands verl the full rows
            seen.update(got["samples"])
            for key in ("log_probs", "entropy"):
                mine = [ref["rows"][key][i] for i in got["samples"]]
                assert [len(t) for t in got["rows"][key]] == [len(t) for t in mine]
                # a row's last log-prob has no label: verl's label roll over its own padded packing
                # fills it, and at TP > 1 that packing pads to the TP size (the stock engine's value at
                # that TP, not the TP=1 reference's); verl slices it away
                cut = -1 if key == "log_probs" and (tp > 1 or tree) else None
                # from row position P - 1 on (what verl's losses read; the shared run skips the other
                # prompt positions: they hold 0)
                starts = [got["prompt_lengths"][i] - 1 for i in got["samples"]]
                diff = max((a[p:cut] - b[p:cut]).abs().max().item() for a, b, p in zip(got["rows"][key], mine, starts))
                worst["rows"] = max(worst["rows"], diff)
                assert diff <= LAYOUT_TOL, (rank, key, diff)
        for mode, grads in got["grads"].items():
            rel = _relative_grad_diff(grads, ref["grads"][mode])
            worst["grads"] = max(worst["grads"], rel)
            assert rel <= LAYOUT_TOL, (rank, mode, rel)
        if dp > 1 or cp > 1:
            assert _relative_grad_diff(got["unreduced"], ref["grads"]["token-mean"]) > 1e-2, rank  # the control fails
    assert seen == set(range(16))
    print(f"{name}: max |diff| rows {worst['rows']:.2e}, max relative gradient diff {worst['grads']:.2e}; "
          f"rank 0 build {results[0]['build_s']} s, passes {results[0]['passes_s']} s")


# prefix trees (`PS_BRIDGE_TREE=1`, threshold 0; dynamic micro-batches) at a parallel layout, against our
# engine on one process, unshared, on the same tree samples (`verl_harness.tree_samples_for_engines`)
# name: (processes, tp, pp, cp, sequence parallel); the four-rank layouts combine two kinds of model parallelism
TREE_LAYOUTS = {
    "tree_cp2": (2, 1, 1, 2, False),
    "tree_pp2": (2, 1, 2, 1, False),
    "tree_tp2_cp2": (4, 2, 1, 2, False),
    "tree_pp2_cp2": (4, 1, 2, 2, False),
    "tree_tp2_sp_pp2": (4, 2, 2, 1, True),
}


@pytest.fixture(scope="module")
def tree_engine_at_cp1_unshared(qwen2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tree_layout_ref") / "ref"
    _, (ref,) = _layout(qwen2_dir, 1, 1, 1, 1, False, False, out, tree=True)
    assert ref["rows"] is not None and ref["samples"] == list(range(16)) and max(ref["depths"]) == 0
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TREE_LAYOUTS))
def test_tree_parallel_layout_matches_engine_at_cp1(qwen2_dir, tree_engine_at_cp1_unshared, tmp_path, name):
    """Our engine on prefix trees at CP=2 (contiguous shards of the tree pack), PP=2 (every stage packs
    the same trees from the micro-batch) and, on four ranks, TP=2 x CP=2, PP=2 x CP=2 and TP=2+SP x PP=2,
    CPU processes (gloo, fp32): `infer_batch` log-probs and entropy (temperature 0.7) and, for verl's
    token-mean and seq-mean-token-mean `ppo_loss`, every reduced HF-named gradient equal our engine's at
    CP=1 unshared on one process (which equals verl's stock engine: test_verl_engine.py; the stock
    engine has no CP on a CPU, without Transformer Engine); every rank ran trees deeper than one level."""
    nproc, tp, pp, cp, sp = TREE_LAYOUTS[name]
    # four processes on a small shared CPU host take several times as long as two
    results, ranks = _layout(qwen2_dir, nproc, tp, pp, cp, sp, False, tmp_path / name, tree=True,
                             timeout=600 * nproc // 2)
    _check_layout_ranks(name, results, ranks, tree_engine_at_cp1_unshared, (tp, pp, cp, 1), tree=True)


@pytest.fixture(scope="module")
def qwen35_moe_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen35moe"))
    vt.tiny_checkpoint(path, "qwen3.5-moe")
    return path


@pytest.fixture(scope="module")
def engine_at_ep1_unshared(qwen35_moe_dir, tmp_path_factory):
    """Our engine at EP=1 CP=1 on one process, sharing off, over the whole batch: the reference of
    the expert-parallel runs."""
    out = tmp_path_factory.mktemp("ep1") / "ep1"
    results, (ref,) = _harness_ranks(["expert_parallel", qwen35_moe_dir, 1, out], 1, out)
    assert results[0]["ep_size"] == 1 and results[0]["cp_size"] == 1 and ref["samples"] == list(range(16))
    return ref


EP_TOL = 1e-5
# float32 summation noise in a gradient whose per-token terms nearly cancel: the tiny Qwen3.5 MoE's
# A_log gradient is 1.7e-6 at most, and the expert-parallel ranks' sums differ from the reference's by
# 2e-11 (1.2e-5 of it) on a CPU with AMX tiles
GRAD_FLOOR = 1e-10


def _expert_parallel_matches(ref: dict, ranks: list, tree: bool = False) -> dict:
    """Each rank of an expert-parallel run against the EP=1 unshared reference: its `infer_batch`
    log-probs / entropy rows (from position P - 1 on) equal the reference's rows of its samples, and
    every gradient after megatron's DDP reduction equals the reference's: dense weights on every
    rank, local expert i of EP rank r against the reference's global expert r * (local count) + i.
    The worst row and relative gradient differences. With `tree` (the tree samples: groups of 3 and a
    chain of single samples) the parts are not groups of 4, and each row's unlabelled last log-prob
    (filled from the next sample of each run's own packing) is left out."""
    # the data-parallel ranks split the batch, each rank of one (its CP ranks) the same part (at data
    # parallel size 1, EP carved out of the CP ranks, every rank the whole batch)
    parts = [tuple(got["samples"]) for got in ranks]
    dp = ranks[0]["dp_size"]
    assert len(set(parts)) == dp and all(parts.count(p) == len(ranks) // dp for p in parts)
    assert sorted(i for p in set(parts) for i in p) == ref["samples"]
    worst = {"rows": 0.0, "grads": 0.0}
    for rank, got in enumerate(ranks):
        assert tree or len({i // 4 for i in got["samples"]}) * 4 == len(got["samples"])  # whole groups
        for key in ("log_probs", "entropy"):  # every CP rank hands verl the full rows
            mine = [ref[key][i] for i in got["samples"]]
            assert [len(t) for t in got[key]] == [len(t) for t in mine]
            cut = -1 if tree and key == "log_probs" else None
            diff = max((a[P - 1:cut] - b[P - 1:cut]).abs().max().item()
                       for a, b, P in zip(got[key], mine, got["prompt_lengths"]))
            worst["rows"] = max(worst["rows"], diff)
            assert diff <= EP_TOL, (rank, key, diff)
        experts = 0
        for name, g in got["grads"].items():
            m = re.match(r"(.*\.mlp\.experts\.linear_fc\d\.weight)(\d+)$", name)
            if m:  # local expert i of EP rank r is global expert r * (local count) + i
                per_rank = sum(1 for n in got["grads"] if n.startswith(m.group(1)) and n[len(m.group(1)):].isdigit())
                name_ref, experts = m.group(1) + str(got["ep_rank"] * per_rank + int(m.group(2))), experts + 1
            else:
                name_ref = name
            r = ref["grads"][name_ref]
            assert r.shape == g.shape and r.abs().max() > 0, name
            err, scale = (g - r).abs().max().item(), r.abs().max().item()
            rel = err / scale
            if rel > worst["grads"]:
                worst["grads"], worst["grad_name"] = rel, name
            assert err <= EP_TOL * scale + GRAD_FLOOR, (rank, name, name_ref, rel)
        assert experts > 0 and len(got["grads"]) < len(ref["grads"])  # the experts really are split
    return worst


def test_expert_parallel_two_ranks_match_engine_at_ep1(qwen35_moe_dir, engine_at_ep1_unshared, tmp_path):
    """Our engine at expert_model_parallel_size=2 on two CPU processes (gloo, fp32; data parallel size 2,
    each rank its own whole groups as verl's trainer hands them, megatron's allgather dispatcher) with
    prefix sharing, against our engine at EP=1 on one process, unshared, over the whole batch (same
    checkpoint, same per-sample advantages): each rank's `infer_batch` log-probs / entropy (temperature
    0.7) equal the reference's rows of its samples; the policy-loss gradients after megatron's DDP
    reduction (the mean over the two DP ranks of a loss scaled by verl's `dp_size`, as verl's losses
    are) equal the single-rank gradient of the global token mean: dense weights on both ranks, and the
    local experts of EP rank r against the reference's global experts r*2, r*2+1."""
    results, ranks = _harness_ranks(["expert_parallel", qwen35_moe_dir, 2, tmp_path / "ep2"], 2, tmp_path / "ep2")
    assert [(r["ep_size"], r["dp_size"], r["cp_size"]) for r in results] == [(2, 2, 1)] * 2, results
    assert [got["ep_rank"] for got in ranks] == [0, 1]
    worst = _expert_parallel_matches(engine_at_ep1_unshared, ranks)
    print(f"ep2: max |diff| rows {worst['rows']:.2e}, max relative gradient diff {worst['grads']:.2e}")


@pytest.mark.slow
def test_expert_parallel_with_context_parallel_matches_engine_at_ep1(qwen35_moe_dir, engine_at_ep1_unshared, tmp_path):
    """EP=2 x CP=2 on four CPU processes (gloo, fp32, allgather dispatcher), prefix sharing on, against
    the same EP=1 CP=1 unshared single-rank reference. megatron's layout: data parallel size 2
    (ranks {0, 1} and {2, 3} are the CP pairs of data-parallel ranks 0 and 1), the expert-parallel
    groups carved out of data-parallel-with-CP, here {0, 1} and {2, 3}: the two CP ranks of a
    data-parallel rank hold different experts, and the expert gradients are reduced over the
    expert-data-parallel group ({0, 2}, {1, 3}), the dense ones over data-parallel-with-CP. The loss is
    verl's normalisation (token mean over the mini-batch times verl's `dp_size`), which megatron's
    schedule scales by the CP size and its DDP divides by the data-parallel-with-CP size, experts
    included: the gradient is the single-rank one. Every CP rank hands verl the full rows."""
    results, ranks = _harness_ranks(["expert_parallel", qwen35_moe_dir, 2, tmp_path / "ep2cp2", 2], 4, tmp_path / "ep2cp2")
    assert [(r["ep_size"], r["dp_size"], r["cp_size"]) for r in results] == [(2, 2, 2)] * 4, results
    assert [(got["cp_rank"], got["ep_rank"]) for got in ranks] == [(0, 0), (1, 1), (0, 0), (1, 1)]
    assert ranks[0]["samples"] == ranks[1]["samples"] and ranks[2]["samples"] == ranks[3]["samples"]
    worst = _expert_parallel_matches(engine_at_ep1_unshared, ranks)
    print(f"ep2_cp2: max |diff| rows {worst['rows']:.2e}, max relative gradient diff {worst['grads']:.2e}")


@pytest.fixture(scope="module")
def tree_engine_at_ep1_unshared(qwen35_moe_dir, tmp_path_factory):
    """Our engine at EP=1 CP=1 on one process, sharing off, over the tree samples (in the micro-batches
    of the EP=2 ranks' parts, one after the other): the reference of the tree runs with experts split."""
    ref_out = tmp_path_factory.mktemp("ep1_tree") / "ep1_tree"
    _, (ref,) = _harness_ranks(["expert_parallel", qwen35_moe_dir, 1, ref_out, 1, "tree"], 1, ref_out)
    assert ref["samples"] == list(range(16)) and max(ref["depths"]) == 0
    return ref


@pytest.mark.slow
def test_tree_expert_parallel_two_ranks_match_engine_at_ep1(qwen35_moe_dir, tree_engine_at_ep1_unshared, tmp_path):
    """Prefix trees (`PS_BRIDGE_TREE=1`, threshold 0) at expert_model_parallel_size=2 on two CPU processes
    (data parallel size 2, the samples split by uid as verl's trainer splits them: the system prompt on
    both ranks, computed on each): rows and every reduced gradient (experts by their global ids) equal
    our engine's at EP=1 on one process, unshared, over the whole batch; both ranks ran trees deeper
    than one level."""
    ref = tree_engine_at_ep1_unshared
    results, ranks = _harness_ranks(["expert_parallel", qwen35_moe_dir, 2, tmp_path / "ep2_tree", 1, "tree"], 2,
                                    tmp_path / "ep2_tree")
    assert [(r["ep_size"], r["dp_size"], r["cp_size"]) for r in results] == [(2, 2, 1)] * 2, results
    assert all(max(got["depths"]) >= 2 for got in ranks), [got["depths"] for got in ranks]
    worst = _expert_parallel_matches(ref, ranks, tree=True)
    print(f"tree ep2: max |diff| rows {worst['rows']:.2e}, max relative gradient diff {worst['grads']:.2e} "
          f"({worst.get('grad_name')})")


@pytest.mark.slow
def test_tree_context_parallel_with_expert_parallel_two_ranks(qwen35_moe_dir, tree_engine_at_ep1_unshared, tmp_path):
    """Prefix trees under context parallelism combined with another layout, on two CPU processes:
    CP=2 x EP=2 (data parallel size 1: megatron carves the expert-parallel group out of the two CP ranks,
    so each CP rank runs its contiguous shard of the tree pack and holds half of the experts; the MoE
    token weights count the samples through each position of the shard). Rows (every CP rank hands verl
    the full rows) and every reduced gradient (experts by their global ids) equal our engine's at
    EP=1 CP=1 on one process, unshared, over the same micro-batches; both ranks ran trees deeper than
    one level. (TP x CP and CP x PP need four processes.)"""
    out = tmp_path / "cp2_ep2_tree"
    results, ranks = _harness_ranks(["expert_parallel", qwen35_moe_dir, 2, out, 2, "tree"], 2, out)
    assert [(r["ep_size"], r["dp_size"], r["cp_size"]) for r in results] == [(2, 1, 2)] * 2, results
    assert [(got["cp_rank"], got["ep_rank"]) for got in ranks] == [(0, 0), (1, 1)]
    assert all(max(got["depths"]) >= 2 for got in ranks), [got["depths"] for got in ranks]
    worst = _expert_parallel_matches(tree_engine_at_ep1_unshared, ranks, tree=True)
    print(f"tree cp2 x ep2: max |diff| rows {worst['rows']:.2e}, max relative gradient diff {worst['grads']:.2e} "
          f"({worst.get('grad_name')})")
