"""Qwen3.5 with tensor parallelism 2 and sequence parallelism on CPU (gloo, 2 processes).

TP shards the Gated DeltaNet heads (in_proj, conv1d, A_log, dt_bias, out_proj) and the attention
heads; SP shards the tokens between the layers. The prefix-shared and unshared log-probs, gathered
over the vocabulary shards, must equal HF's. About a minute per architecture on 2 CPU cores.
"""

import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow

SAMPLE_ARGS = dict(num_prompts=2, n=3, prompt_len=(5, 12), response_len=(1, 6), seed=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, path, port, queue):
    import os

    import torch.cuda.random as cuda_random
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    # ps_bridge.compat.cuda_on_cpu does not cover torch.cuda.random.*, which megatron's RNG
    # tracker calls when the embedding forks it under sequence parallelism
    cuda_random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda_random.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    try:
        from ps_bridge.layout import build_layout
        from ps_bridge.rows import PackedRows
        from ps_bridge.tools.runtime import forward_logits, load_model
        from ps_bridge.tools.tiny_checkpoints import grpo_like_samples

        loaded = load_model(path, tp=2, sequence_parallel=True)
        samples = grpo_like_samples(248, **SAMPLE_ARGS)
        result = []
        for share in (True, False):
            layout = build_layout(samples, share=share, pad_multiple=2, vocab_size=loaded.vocab_size)
            with torch.no_grad():
                logits = forward_logits(loaded, layout).contiguous()
            shards = [torch.empty_like(logits) for _ in range(2)]
            dist.all_gather(shards, logits)  # vocabulary-parallel logits -> full vocabulary
            extractor = PackedRows.of(layout)
            rows = extractor.logprobs(torch.cat(shards, dim=-1))
            result.append([t.tolist() for t in extractor.responses(rows)])  # plain lists: no shared memory
        if rank == 0:
            queue.put(result)
    except BaseException as e:  # report instead of hanging the parent
        queue.put(repr(e))
        raise


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3.5-moe"])
def test_tp2_sequence_parallel_logprobs_equal_hf(name, tmp_path):
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS, grpo_like_samples, hf_sample_logprobs

    hf = TINY_BUILDERS[name](str(tmp_path))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path), port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert not isinstance(result, str), result
    shared, unshared = result
    ref = hf_sample_logprobs(hf, grpo_like_samples(248, **SAMPLE_ARGS))
    for got in (shared, unshared):
        diff = max((torch.tensor(a) - b).abs().max().item() for a, b in zip(got, ref))
        assert diff <= 1e-5, (name, diff)
