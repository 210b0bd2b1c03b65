"""Reproducible vLLM sampling in verl's `main_ppo`: one seed per rollout request, derived from the rollout
seed, the prompt's token ids and how many requests of the same prompt came before.

Why: without a per-request seed, vLLM draws every request's sampling noise from one generator seeded when
its engine starts (vllm/v1/sample/ops/topk_topp_sampler.py:200, `q.exponential_()` over the whole batch),
so which noise a request gets depends on which requests vLLM's scheduler batched with it: two runs from
the same weights and seed sample different responses, and a run resumed from a checkpoint restarts the
generator. verl's own `rollout.full_determinism` seeds each request, but with one seed for all of them
(verl 0.9.1, verl/workers/rollout/vllm_rollout/vllm_async_server.py:626-627,
`sampling_params.setdefault("seed", self.replica_rank + self.config.seed)`): the n responses of a prompt
are then identical and GRPO's advantages all 0. It also turns on `VLLM_BATCH_INVARIANT` and
`torch.use_deterministic_algorithms` (verl/trainer/main_ppo.py:47-50), which vLLM's CPU build does not need.

Here each request gets `sampling_params["seed"]` (vLLM then samples it from its own generator,
vllm/v1/worker/gpu_model_runner.py:1211, which the CPU runner inherits): a hash of verl's rollout seed, the
replica, the request's `priority`, the prompt's token ids and k, the number of earlier requests of the same
prompt on this server. verl's trainer sends a prompt's n samples as n requests that differ in nothing the
server sees (verl/trainer/ppo/v1/agent_loop_tq.py:122-127: the sample index `i` stays in the agent loop; the
request ids are random), so k is what tells them apart: they get seeds k = 0..n-1, in whatever order they
arrive, and the n responses of a prompt are the same multiset in any run, resumed or not, whatever vLLM
batches together (a prompt seen again, in a later epoch, continues its count). A request that already
carries a seed keeps it.

Loaded through `VERL_USE_EXTERNAL_MODULES` (verl/__init__.py:49-52: every process that imports verl, the
vLLM server actor included) by `ps_bridge.tools.grpo.launch`, on GPUs and CPUs alike: it changes which
random numbers vLLM draws, nothing else; it is no part of ps-bridge's engine.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from typing import List, Sequence

from ps_bridge.compat.main_ppo_on_cpu import _after_import

SERVER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"
_INSTALLED: List[str] = []


def request_seed(rollout_seed: int, replica_rank: int, priority: int, prompt_ids: Sequence[int], k: int = 0) -> int:
    """A 31-bit seed (torch generators and vLLM's SamplingParams take it) from the request's identity; k: the
    number of earlier requests of the same prompt."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<qqqq", int(rollout_seed), int(replica_rank), int(priority), int(k)))
    h.update(struct.pack(f"<{len(prompt_ids)}q", *(int(t) for t in prompt_ids)))
    return int.from_bytes(h.digest(), "little") & 0x7FFFFFFF


def _seed_each_request(server_module) -> None:
    cls = server_module.vLLMHttpServer
    stock = cls.generate
    if getattr(stock, "__ps_bridge_seeds__", False):
        return

    @functools.wraps(stock)
    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        if "seed" not in sampling_params:
            priority = kwargs.get("priority", 0)
            ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
            counts = self.__dict__.setdefault("_ps_bridge_prompt_counts", {})
            key = (priority, tuple(ids))
            k = counts.get(key, 0)
            counts[key] = k + 1  # no await in between: asyncio runs this block for one request at a time
            sampling_params = dict(sampling_params,
                                   seed=request_seed(self.config.seed, self.replica_rank, priority, ids, k))
            if not _INSTALLED:
                _INSTALLED.append("per-request seeds")
                print("[ps_bridge.compat.rollout_seeds] vLLM samples each request with its own seed "
                      "(rollout seed, prompt, its count)", flush=True)
        return await stock(self, prompt_ids, sampling_params, request_id, *args, **kwargs)

    generate.__ps_bridge_seeds__ = True
    cls.generate = generate


def install() -> None:
    _after_import(SERVER_MODULE, _seed_each_request)


if __name__ in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","):
    install()  # imported by verl (`VERL_USE_EXTERNAL_MODULES`); any other import only reads this module
