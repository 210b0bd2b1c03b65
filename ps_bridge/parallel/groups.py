"""Process groups of a prefix-shared run: torch.distributed and megatron's model-parallel groups
(torchrun's variables are read here), the output rank, a maximum over ranks."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from ps_bridge.compat import cuda_on_cpu

# whether `init_parallel` created torch.distributed's process group as a torchrun worker
_created_under_torchrun = False


def launched_world_size() -> int:
    """The world size torchrun launched (1 when run as a plain process)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(
    tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234, ep: int = 1, timeout_s: Optional[float] = None
) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU; world size 1 when not launched by torchrun) and
    megatron's model-parallel groups, seeded; idempotent. `timeout_s`: how long a collective may
    wait before it fails (torch's default when None)."""
    cuda_on_cpu.enable()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # launched by torchrun
            dist.init_process_group(backend, **timeout)
            global _created_under_torchrun
            _created_under_torchrun = True
        else:  # a single process: a private store on a free port, the environment left alone
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **timeout)
    # imported here: heavy, only a run that builds groups loads megatron-core
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            expert_model_parallel_size=ep,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def close_parallel() -> None:
    """Destroy megatron's model-parallel groups and the process group, where `init_parallel` created
    them in a torchrun worker; otherwise nothing (a caller that owns the group, verl or a test,
    keeps it). Called when a command has ended normally: a gloo process group still alive at
    interpreter exit can abort the worker (SIGABRT, "terminate called without an active exception":
    its worker threads are destroyed unjoined, pytorch/pytorch#65513), while destroying it after an
    error, with a peer still inside a collective, would hang that peer instead."""
    global _created_under_torchrun
    if not (_created_under_torchrun and dist.is_initialized()):
        return
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    _created_under_torchrun = False


def is_output_rank() -> bool:
    """Global rank 0 writes files and prints results; every rank logs its own `[PS]` lines."""
    return not dist.is_initialized() or dist.get_rank() == 0


def max_over_ranks(value: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _collective_device() -> torch.device:
    # NCCL collectives need CUDA tensors; gloo takes CPU tensors
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
