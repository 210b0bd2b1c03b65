"""verl's Megatron engine (0.8.0 and 0.9.1) on a machine without an accelerator (docs/how-it-works.md section 8).

Everything here only makes verl's own engine code runnable on a CPU (the tests, and the `--smoke`
runs of the commands); none of it changes what the engines compute:
- `install_absent_module_placeholders`: modules verl imports on the engine path but never runs
  there (ray, peft, datasets, ...), placed in `sys.modules` only when they are not installed.
- `use_cpu_platform`: verl's device platform reporting "cpu", so verl allocates on the CPU.
- `engine_call_on_cpu`: megatron-core allocates a few scalars with a hard-coded `device="cuda"`;
  inside this context such factory calls land on the CPU (and torch.compile is off).
- `prepare_cpu_process`: all of it, in the import order that works without TE and without CUDA.

Kept outside the `ps_bridge.verl` package: importing that package activates the plugin, and on a
CPU machine verl only imports after the placeholders below.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import List, Sequence

import torch

from ps_bridge.compat import cuda_on_cpu
from ps_bridge.compat import verl as verl_compat
from ps_bridge.compat.te_placeholder import import_megatron_bridge

# verl imports these on the engine's import path without using them there.
VERL_IMPORT_ONLY_MODULES = ("ray", "peft", "accelerate", "datasets", "pandas", "PIL", "dill", "wandb", "torchdata",
                            # Megatron-Bridge's training config (verl builds its DDP config with it)
                            # imports its data loaders
                            "megatron.energon",
                            # verl 0.8.0 builds its bridge through Megatron-Bridge's training utilities,
                            # which import torch's TensorBoard writer
                            "tensorboard")

# modules of installed packages that only wrap one of the above: placed in front of the real finders
# when the package they wrap is absent
IMPORT_ONLY_WRAPPERS = {"tensorboard": ("torch.utils.tensorboard",)}


class _ImportOnly:
    """A name from a module that is not installed: importable, fails loudly if used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _ImportOnly(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} belongs to a package that is not installed here (placeholder for the tests)")

    def __mro_entries__(self, bases):
        return (object,)


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: Sequence[str]):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if any(name == root or name.startswith(root + ".") for root in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def module_getattr(item, _name=spec.name):
            if item.startswith("__"):
                raise AttributeError(item)
            return _ImportOnly(f"{_name}.{item}")

        module.__getattr__ = module_getattr
        module.__ps_bridge_placeholder__ = True
        # a version older than any: availability probes that read it (transformers' is_*_available
        # with a minimum version, which also find the module spec) answer "not available"
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        pass


def install_absent_module_placeholders(names: Sequence[str] = VERL_IMPORT_ONLY_MODULES) -> List[str]:
    """Placeholders for those of `names` that are not installed (and for the modules that only wrap
    them, `IMPORT_ONLY_WRAPPERS`); returns the ones placed."""
    absent = [n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None]
    if absent and not any(isinstance(f, _PlaceholderFinder) for f in sys.meta_path):
        sys.meta_path.append(_PlaceholderFinder(absent))
        wrappers = [w for n in absent for w in IMPORT_ONLY_WRAPPERS.get(n, ()) if w not in sys.modules]
        if wrappers:
            sys.meta_path.insert(0, _PlaceholderFinder(wrappers))
    return absent


def prepare_cpu_process() -> None:
    """Imports in the order that works without TE and without an accelerator, then verl."""
    install_absent_module_placeholders()
    cuda_on_cpu.enable()
    import_megatron_bridge()
    use_cpu_platform()
    verl_compat.padding_helpers_without_flash_attn()
    _megatron_rng_tracker_on_cpu()
    _cuda_streams_on_cpu()
    _distributed_optimizer_on_cpu()


class _CPUEvent:
    """An event recorded on a `_CPUStream`: complete at once."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CPUStream:
    """What megatron does with its side streams on the CPU (the DDP wrapper's initialisation stream,
    the MoE all-to-all dispatcher's device-to-host copy stream): nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> _CPUEvent:
        return _CPUEvent()


def _cuda_streams_on_cpu() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.Stream = _CPUStream
    torch.cuda.current_stream = lambda device=None: _CPUStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


@contextlib.contextmanager
def _cpu_tensors_typed_as_cuda():
    """Inside: a CPU tensor's `.type()` names the CUDA tensor type of its dtype ("torch.cuda.FloatTensor")."""
    type_of = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            name = type_of(self)  # (a Parameter's goes through torch's function dispatch back to here)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return type_of(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = type_of


def _distributed_optimizer_on_cpu() -> None:
    """megatron's distributed optimizer sorts the parameters it shards by their type name and takes CUDA
    ones only (megatron/core/optimizer/distrib_optimizer.py, `_build_model_and_main_param_groups`:
    `model_param.type() == 'torch.cuda.FloatTensor'`, else TypeError); on the CPU the same parameters
    are sorted under their CUDA type names (gloo has the reduce-scatter and all-gather it uses)."""
    if torch.cuda.is_available():
        return
    # imported here: megatron-core is heavy
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    build = getattr(DistributedOptimizer.__dict__.get("_build_model_and_main_param_groups"), "__func__", None)
    if build is None or getattr(build, "__ps_bridge_cpu__", False):
        return

    def _build_model_and_main_param_groups(cls, *args, **kwargs):
        with _cpu_tensors_typed_as_cuda():
            return build(cls, *args, **kwargs)

    _build_model_and_main_param_groups.__ps_bridge_cpu__ = True
    DistributedOptimizer._build_model_and_main_param_groups = classmethod(_build_model_and_main_param_groups)


def _megatron_rng_tracker_on_cpu() -> None:
    """verl builds the model without `use_cpu_initialization`, so megatron's weight init forks its
    CUDA RNG tracker; without CUDA the tracker forks the CPU generator instead."""
    if torch.cuda.is_available():
        return
    # imported here: megatron-core is heavy
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def cpu_device_module_can_empty_cache() -> None:
    """verl 0.8.0 (no platform plugin) takes its device module as `getattr(torch, "cpu")` and calls
    its `empty_cache()` after moving a model (e.g. `get_per_tensor_param`, the weight export); torch's
    `torch.cpu` has none (2.9.1-2.14.1): give it a no-op, a CPU has no cache to empty."""
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None


def use_cpu_platform() -> None:
    """verl's device "cpu" where there is no accelerator, and its engine lookup taking the GPU
    engine's key from `VERL_ENGINE_DEVICE` (`ps_bridge.compat.verl`: verl 0.8.0 reads torch's device
    itself, "cpu" already; verl 0.9.1 asks its platform plugin, made to answer "cpu" here)."""
    if torch.cuda.is_available():
        return
    verl_compat.engine_lookup_honours_device_override()
    platform_manager = verl_compat.platform_manager()
    if platform_manager is None:
        cpu_device_module_can_empty_cache()
        return
    # imported here: verl is optional (requirements-verl.txt)
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class CPUPlatform(PlatformCUDA):
        """verl's CUDA platform with the device name "cpu": verl allocates with get_device_name()."""

        @property
        def device_name(self) -> str:
            return "cpu"

        def current_device(self):
            return torch.device("cpu")  # verl moves batches with .to(get_device_id())

        def is_available(self) -> bool:
            return True

        def synchronize(self, device_index=None) -> None:
            pass

        def empty_cache(self) -> None:
            pass

    if not isinstance(platform_manager._current_platform, CPUPlatform.__mro__[0]):
        platform_manager._current_platform = CPUPlatform()


class _CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    # the `*_like` ones: megatron's fully parallel dist-checkpoint load receives the shards other data-parallel
    # ranks loaded into `torch.empty_like(t, device="cuda")` (dist_checkpointing/exchange_utils.py)
    FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange,
                 torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and str(kwargs.get("device", "")).startswith("cuda"):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def engine_call_on_cpu():
    """Around every engine call in the tests: megatron's `device="cuda"` factory calls land on the
    CPU, and verl's `torch.compile`d entropy runs eagerly (compiling takes 10-14 s and a C++
    compiler; scoped here rather than TORCHDYNAMO_DISABLE so other tests keep torch.compile)."""
    # imported here: torch._dynamo is heavy (torch's compiler stack); only engine calls need it
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        if torch.cuda.is_available():
            yield
            return
        with _CudaFactoriesOnCpu():
            yield
