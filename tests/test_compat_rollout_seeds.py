"""`ps_bridge.compat.rollout_seeds`: each vLLM request of verl's rollout gets its own seed, stable across runs,
different for the n samples of one prompt, and a request's own seed is kept. The patch is exercised on a
stand-in of verl's `vLLMHttpServer` (the same `generate` signature)."""

import asyncio
import sys
import types

from ps_bridge.compat import rollout_seeds
from ps_bridge.compat.rollout_seeds import request_seed


def test_request_seed_is_stable_and_differs_per_sample_and_prompt():
    prompt = [11, 12, 13]
    seeds = [request_seed(1, 0, 0, prompt, k) for k in range(8)]
    assert seeds == [request_seed(1, 0, 0, prompt, k) for k in range(8)]  # another run: the same
    assert len(set(seeds)) == 8  # the n samples of a prompt are sampled differently
    assert request_seed(1, 0, 0, prompt) != request_seed(1, 0, 1, prompt)
    assert request_seed(1, 0, 0, prompt) != request_seed(1, 0, 0, [11, 12, 14])
    assert request_seed(1, 0, 0, prompt) != request_seed(2, 0, 0, prompt)
    assert request_seed(1, 0, 0, prompt) != request_seed(1, 1, 0, prompt)
    assert all(0 <= s < 2 ** 31 for s in seeds)


def _stand_in_server_module():
    """verl's server module as far as the patch reads it: `vLLMHttpServer.generate`'s signature, its config's
    seed and its replica rank (verl/workers/rollout/vllm_rollout/vllm_async_server.py)."""
    module = types.ModuleType("vllm_async_server")

    class Config:
        seed = 7

    class vLLMHttpServer:
        config, replica_rank = Config(), 0

        async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, priority=0):
            return sampling_params.get("seed")

    module.vLLMHttpServer = vLLMHttpServer
    return module


def test_the_server_gives_each_request_its_seed():
    module = _stand_in_server_module()
    rollout_seeds._seed_each_request(module)
    rollout_seeds._seed_each_request(module)  # a second install changes nothing
    server = module.vLLMHttpServer()
    run = lambda **kw: asyncio.run(server.generate(**kw))  # noqa: E731
    # verl's trainer sends a prompt's n samples as identical requests (no priority, random request ids)
    group = [run(prompt_ids=[1, 2, 3], sampling_params={"temperature": 1.0}, request_id=f"r{i}") for i in range(4)]
    assert group == [request_seed(7, 0, 0, [1, 2, 3], k) for k in range(4)]
    assert len(set(group)) == 4
    other = run(prompt_ids=[1, 2, 4], sampling_params={}, request_id="y")
    assert other == request_seed(7, 0, 0, [1, 2, 4], 0)  # another prompt counts from 0
    a = run(prompt_ids=[1, 2, 3], sampling_params={}, request_id="x", priority=3)
    assert a == request_seed(7, 0, 3, [1, 2, 3], 0)
    params = {"seed": 5}
    assert run(prompt_ids=[1], sampling_params=params, request_id="z", priority=1) == 5  # its own seed is kept
    assert params == {"seed": 5}


def test_installed_only_as_an_import_hook_for_verls_server_module():
    before = list(sys.meta_path)
    try:
        rollout_seeds.install()
        added = [f for f in sys.meta_path if f not in before]
        assert [getattr(f, "name", None) for f in added] == [rollout_seeds.SERVER_MODULE]
        assert rollout_seeds.SERVER_MODULE not in sys.modules  # nothing of verl imported by the install
    finally:
        sys.meta_path[:] = before
