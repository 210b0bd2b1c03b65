"""What the parallel tests share: the micro-batches (also run by the torchrun workers), the
single-rank unshared reference, the torchrun launcher and the per-rank log checks."""

import contextlib
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from ps_bridge.tools.compare import loss_weights
from ps_bridge.layout import Sample
from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

# docs/how-it-works.md section 6: valid lengths [5, 2] become padded [6, 2] at TP=2
PADDING_EXAMPLE = Sample([11, 12, 13, 14, 15], [16, 17])


def parallel_micro_batches() -> List[List[Sample]]:
    """Micro-batches of different packed lengths (pipeline stages must exchange shapes), one
    group split across two of them, and the padding example on its own."""
    groups = grpo_like_samples(256, num_prompts=3, n=4, prompt_len=(6, 20), response_len=(1, 9), seed=21, shuffle=False)
    return [[PADDING_EXAMPLE], groups[:6], groups[6:]]


def cp_micro_batches(seed: int = 0) -> List[List[Sample]]:
    """Fuzzed micro-batches for context parallelism, drawn from `seed` alone (every rank draws the
    same ones, or the ranks would hang): two edge groups whose pack is 16 tokens at CP=2, TP=1,
    so the shard boundary (position 8) falls right at a prompt's last token, once as the last
    token of shard 0 (the responses on shard 1 fork from another rank) and once as the first
    token of shard 1 (the rest of the prompt on shard 0); then random groups (1 to 5 responses,
    random prompt and response lengths, so the boundaries cut prompts and responses anywhere),
    one of them split across two micro-batches."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(1, 256) for _ in range(n)]

    def group(prompt_len, response_lens):
        prompt = ids(prompt_len)
        return [Sample(prompt, ids(r)) for r in response_lens]

    edges = [group(8, [3, 3, 2]), group(9, [2, 2, 2, 1])]
    out = list(edges)
    for _ in range(2):
        groups = [group(rng.randint(3, 24), [rng.randint(1, 10) for _ in range(rng.randint(1, 5))]) for _ in range(3)]
        groups.insert(1, group(rng.randint(3, 24), [rng.randint(1, 10) for _ in range(4)]))
        flat = [s for g in groups for s in g]
        cut = len(groups[0]) + 2  # inside the four-response group
        out += [flat[:cut], flat[cut:]]
    return out


def ep_micro_batches() -> List[List[Sample]]:
    """For expert parallelism (data-parallel ranks): micro-batches of at least two whole groups,
    one group split across two of them; token ids below the tiny Qwen3.5 vocabularies' special ids."""
    groups = grpo_like_samples(248, num_prompts=5, n=3, prompt_len=(6, 20), response_len=(1, 9), seed=22, shuffle=False)
    return [groups[:7], groups[7:]]


def tree_micro_batches() -> List[List[Sample]]:
    """Prefix trees (`tree_cases.tree_samples`: a system prompt shared across prompts, depth up to 4,
    nodes of 1-3 tokens between long ones, samples that are prefixes of others, identical samples):
    one tree (depth 4, one root shared by all 17 samples) split across two micro-batches, and a
    second tree (depth 3) whole."""
    from tree_cases import tree_samples

    first = tree_samples(0)
    return [first[:8], first[8:], tree_samples(2)]


def tree_ep_micro_batches() -> List[List[Sample]]:
    """For a data-parallel split of trees: `tree_micro_batches` (a root shared by every sample: split
    below it, computed on both ranks), then two trees of depth 3 and 4 with disjoint tokens in one
    micro-batch (each rank gets one whole)."""
    from tree_cases import tree_samples

    other = [Sample([t + 16 for t in s.prompt], [t + 16 for t in s.response]) for s in tree_samples(10)]
    return tree_micro_batches() + [tree_samples(2) + other]


def image_micro_batches() -> List[List[Sample]]:
    from image_cases import image_micro_batches

    return image_micro_batches()


MICRO_BATCHES = {"parallel": parallel_micro_batches, "cp": cp_micro_batches, "ep": ep_micro_batches,
                 "tree": tree_micro_batches, "tree_ep": tree_ep_micro_batches, "images": image_micro_batches}


def micro_batch_weights(micro_batches) -> List[List[torch.Tensor]]:
    return [loss_weights(mb, seed=i) for i, mb in enumerate(micro_batches)]


@contextlib.contextmanager
def recorded_aux_losses():
    """The load-balancing loss value (its coefficient divided out) each prefix-shared MoE router
    attaches inside the block, as a list of (layer number, value) in call order."""
    from ps_bridge.models.moe import PrefixSharedTopKRouter

    records = []
    original = PrefixSharedTopKRouter.attach_and_log_load_balancing_loss

    def record(self, activation, coeff, aux_loss, name, *args, **kwargs):
        records.append((self.layer_number, float(aux_loss.detach() / coeff)))
        return original(self, activation, coeff, aux_loss, name, *args, **kwargs)

    PrefixSharedTopKRouter.attach_and_log_load_balancing_loss = record
    try:
        yield records
    finally:
        PrefixSharedTopKRouter.attach_and_log_load_balancing_loss = original


def rank_local_router_statistics(loaded) -> bool:
    """Whether the model's load-balancing loss is rank-local: megatron's "aux_loss" reduces the expert
    token counts over TP x CP only, so under data parallelism each DP rank's loss is that of its own
    samples ("global_aux_loss" reduces over the DP ranks too)."""
    return loaded.provider.moe_router_load_balancing_type == "aux_loss"


def data_parallel_unshared(loaded, micro_batches, dp_size: int, tree_options=None):
    """The unshared run at a data-parallel layout, on one process: each DP rank's part of every
    micro-batch (`data_parallel.dp_parts`, the split the EP runs make) run unshared, the gradients
    summed over the parts as the EP runs sum them. Returns (the aux losses keyed (micro-batch, layer),
    summed over the ranks; HF-named gradients). The reference where router statistics are rank-local."""
    from ps_bridge.parallel.gradients import hf_named_gradients
    from ps_bridge.tools.data_parallel import dp_parts
    from ps_bridge.tools.schedule import logprob_pass

    weights = micro_batch_weights(micro_batches)
    parts = [dp_parts(mb, dp_size, tree_options) for mb in micro_batches]
    loaded.model.zero_grad(set_to_none=True)
    aux: dict = {}
    for rank in range(dp_size):
        mine = [[mb[i] for i in p[rank]] for mb, p in zip(micro_batches, parts)]
        mine_weights = [[w[i] for i in p[rank]] for w, p in zip(weights, parts)]
        with recorded_aux_losses() as records:
            logprob_pass(loaded, mine, share=False, loss_weights=mine_weights)
        for key, value in aux_by_micro_batch(records).items():
            aux[key] = aux.get(key, 0.0) + value
    return aux, hf_named_gradients(loaded.bridge, loaded.model)


def aux_by_micro_batch(records) -> dict:
    """`recorded_aux_losses` keyed (micro-batch, layer): each micro-batch calls every router of this
    pipeline stage once, in the schedule's micro-batch order (forward, or the recompute in backward)."""
    per_micro_batch = len({layer for layer, _ in records})
    return {(i // per_micro_batch, layer): value for i, (layer, value) in enumerate(records)}


@contextlib.contextmanager
def provider_settings_on_build(**settings):
    """Models built inside the block have these provider attributes set after the runtime's own
    configuration, before the model is built (e.g. megatron's MoE recompute or load-balancing type)."""
    # patched where the runtime looks it up (ps_bridge.tools.runtime imports it by name)
    import ps_bridge.tools.runtime as runtime

    real = runtime.configure_provider

    def with_settings(provider, parallel):
        real(provider, parallel)
        for name, value in settings.items():
            setattr(provider, name, value)

    runtime.configure_provider = with_settings
    try:
        yield
    finally:
        runtime.configure_provider = real


def moe_recompute_on_build():
    """Models built inside the block have megatron's MoE activation recompute switched on in their
    config (`recompute_granularity="selective"`, `recompute_modules=["moe"]`)."""
    return provider_settings_on_build(recompute_granularity="selective", recompute_modules=["moe"])


# `torchrun` itself, found through this interpreter (no console script needed on PATH)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
WORKER = str(Path(__file__).with_name("parallel_worker.py"))
NUM_LAYERS = 2  # tiny Qwen2 checkpoint


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, argv, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}", *argv]
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def leave_worker() -> None:
    """End a torchrun worker whose results are saved: tear the process group down and leave at once
    (a normal interpreter shutdown of this stack takes ~10 s per run on 2 cores)."""
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def single_rank_unshared(loaded, cases: str = "parallel") -> dict:
    """Single rank, TP=PP=1, every sample its own sequence: log-probs and HF-named gradients."""
    from ps_bridge.parallel.gradients import hf_named_gradients
    from ps_bridge.tools.schedule import logprob_pass

    micro_batches = MICRO_BATCHES[cases]()
    loaded.model.zero_grad(set_to_none=True)
    logprobs = logprob_pass(loaded, micro_batches, share=False, loss_weights=micro_batch_weights(micro_batches))
    grads = hf_named_gradients(loaded.bridge, loaded.model)
    loaded.model.zero_grad(set_to_none=True)
    return dict(logprobs=logprobs, grads=grads)


@pytest.fixture(scope="module")
def unshared_reference(qwen2_loaded):
    return single_rank_unshared(qwen2_loaded)


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    """Qwen2.5 up to 3B ties the LM head to the embedding: under PP the two copies live on the
    first and last stage and their gradients must be summed."""
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2

    path = tmp_path_factory.mktemp("qwen2_tied")
    build_tiny_qwen2(str(path), tie_word_embeddings=True)
    return str(path)


@pytest.fixture(scope="module")
def tied_unshared_reference(tied_checkpoint):
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.runtime import load_model

    return single_rank_unshared(load_model(tied_checkpoint, PrefixSharingConfig(enabled=True)))


def max_logprob_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for mb_a, mb_b in zip(a, b) for x, y in zip(mb_a, mb_b))


def relative_grad_diffs(got: dict, ref: dict) -> dict:
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    return {name: float((got[name] - r).norm() / r.norm()) for name, r in ref.items()}


def expected_layers(rank: int, tp: int, pp: int, num_layers: int = NUM_LAYERS):
    """Layers (1-based) held by `rank`: megatron orders ranks TP fastest, PP slowest."""
    stage = rank // tp
    per_stage = num_layers // pp
    return set(range(stage * per_stage + 1, (stage + 1) * per_stage + 1))


def check_rank_logs(stderr: str, tp: int, pp: int, num_layers: int = NUM_LAYERS, gdn_layers=frozenset()) -> None:
    """Every rank logs its six layouts and enters the prefix-sharing path in each of its layers:
    `[PS][attention]` for attention layers, `[PS][gdn]` for Gated DeltaNet layers (1-based)."""
    for rank in range(tp * pp):
        tag = f"global_rank={rank} tp_rank={rank % tp}/tp_size={tp}"
        layout_lines = [l for l in stderr.splitlines() if f"[PS][prepare][{tag} cp_rank=0/cp_size=1] packed_batch_layout:" in l]
        # three micro-batches, forward+backward and forward-only: six layouts on every rank
        assert len(layout_lines) == 6, f"rank {rank}: {len(layout_lines)} packed_batch_layout lines\n{stderr[-3000:]}"
        padded = "[6, 2]" if tp == 2 else "[5, 2]"
        assert any(f"valid_lengths=[5, 2], padded_lengths={padded}" in l for l in layout_lines), layout_lines
        held = expected_layers(rank, tp, pp, num_layers)
        for kind, expected in (("attention", held - set(gdn_layers)), ("gdn", held & set(gdn_layers))):
            layers = {
                int(m.group(1))
                for m in re.finditer(rf"\[PS\]\[{kind}\]\[{re.escape(tag)}(?: cp_rank=0/cp_size=1)? layer=(\d+)\] enter prefix-sharing path:", stderr)
            }
            assert layers == expected, f"rank {rank}: {kind} lines for layers {layers}, expected {expected}"
    assert "[PS][prepare] PATH 6: sharing detected" in stderr
    assert "[PS][prepare] PATH 5: no sharing detected" in stderr  # the padding example is alone


def check_cp_rank_logs(stderr: str, tp: int, cp: int, pp: int, num_micro_batches: int) -> None:
    """Under CP every (TP rank, CP rank) of every pipeline stage logs each layout with its own
    contiguous, equal shard of the pack, and enters the prefix-sharing path with its CP tag."""
    shards = {}
    pattern = (
        r"\[PS\]\[prepare\]\[global_rank=\d+ tp_rank=(\d+)/tp_size=%d cp_rank=(\d+)/cp_size=%d\] "
        r"cp_shard=\[(\d+), (\d+)\) of (\d+) packed_batch_layout:" % (tp, cp)
    )
    for m in re.finditer(pattern, stderr):
        t, c, a, b, total = map(int, m.groups())
        assert (a, b) == (c * total // cp, (c + 1) * total // cp), m.group(0)
        shards.setdefault((t, c), []).append(total)
    assert set(shards) == {(t, c) for t in range(tp) for c in range(cp)}, sorted(shards)
    for lines in shards.values():  # forward+backward and forward-only, on each pipeline stage
        assert len(lines) == 2 * num_micro_batches * pp, lines
    for c in range(cp):
        assert re.search(rf"\[PS\]\[(attention|gdn)\]\[global_rank=\d+ tp_rank=\d+/tp_size={tp} cp_rank={c}/cp_size={cp} layer=\d+\] enter prefix-sharing path", stderr)


def run_and_compare(
    name: str, nproc: int, flags, tp: int, pp: int, hf_path: str, ref: dict, tmp_path, cp: int = 1, cases: str = "parallel", **log_checks
) -> None:
    """Launch the worker under torchrun and require the single-rank unshared log-probs (with and
    without backward) and HF-named gradients, and every rank's `[PS]` lines. Returns the worker's
    saved results."""
    out = tmp_path / "result.pt"
    proc = torchrun(nproc, [WORKER, "--hf-path", hf_path, "--out", str(out), "--cases", cases, *flags])
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)

    logprob_diff = max_logprob_diff(got["logprobs"], ref["logprobs"])
    grad_diffs = relative_grad_diffs(got["grads"], ref["grads"])
    print(f"{name}: max |logp| diff {logprob_diff:.2e}, max relative grad diff {max(grad_diffs.values()):.2e}")
    assert logprob_diff <= 1e-5
    assert max_logprob_diff(got["forward_only"], ref["logprobs"]) <= 1e-5
    wrong = {hf_name: f"{rel:.2e}" for hf_name, rel in grad_diffs.items() if not rel <= 1e-5}
    assert not wrong, f"{name}: gradients differ (relative): {wrong}"
    if cp > 1:
        check_cp_rank_logs(proc.stderr, tp, cp, pp, len(MICRO_BATCHES[cases]()))
    else:
        check_rank_logs(proc.stderr, tp, pp, **log_checks)
    for rank in range(nproc):
        assert f"[parallel_worker] global_rank={rank} backend=gloo device=cpu" in proc.stderr
    return got
