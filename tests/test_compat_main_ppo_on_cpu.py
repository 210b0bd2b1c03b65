"""The CPU path of verl's main_ppo (`ps_bridge.compat.main_ppo_on_cpu`): applied only without an
accelerator, and each patch doing only what it says. Each case runs in a fresh interpreter, since the
patches are process-wide."""

import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import importlib.metadata, sys
    import torch, torch.distributed
    from ps_bridge.compat.verl_on_cpu import install_absent_module_placeholders
    install_absent_module_placeholders()
    stock_version = importlib.metadata.version
    stock_init_pg = torch.distributed.init_process_group
    stock_zeros = torch.zeros
    hooks_before = list(sys.meta_path)
""")


def _run(body: str) -> str:
    code = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("accelerator", ["cuda", "npu"])
def test_nothing_is_patched_with_an_accelerator(accelerator):
    out = _run(f"""
        if "{accelerator}" == "cuda":
            torch.cuda.is_available = lambda: True
        else:
            torch.npu = type("npu", (), {{"is_available": staticmethod(lambda: True)}})
        from ps_bridge.compat import main_ppo_on_cpu as m
        assert m.has_accelerator()
        assert m.install() is False
        assert m.installed() == []
        assert importlib.metadata.version is stock_version
        assert torch.distributed.init_process_group is stock_init_pg
        assert torch.zeros is stock_zeros
        assert sys.meta_path == hooks_before
        assert "verl" not in sys.modules  # nothing of verl was even imported
        if "{accelerator}" == "npu":
            print("untouched")
            raise SystemExit(0)  # importing verl with a stand-in NPU would import torch_npu
        from verl.plugin.platform import platform_manager
        assert platform_manager._current_platform is None or platform_manager._current_platform.device_name != "cpu"
        import verl.workers.config.engine as engine
        assert not getattr(engine.McoreEngineConfig.__post_init__, "__ps_bridge_cpu__", False)
        print("untouched")
    """)
    assert "untouched" in out


def test_installed_on_a_cpu_and_each_patch_does_what_it_says():
    out = _run("""
        assert not torch.cuda.is_available()
        from ps_bridge.compat import main_ppo_on_cpu as m
        assert m.install() is True
        names = m.installed()
        for expected in ("verl cpu platform", "gloo process groups", "float32 megatron engine config"):
            assert expected in names, names
        # verl's device is the CPU, its backend gloo, no CUDA IPC (weights to vLLM through shared memory)
        from verl.utils.device import get_device_name, get_nccl_backend, is_support_ipc
        assert get_device_name() == "cpu" and get_nccl_backend() == "gloo" and not is_support_ipc()
        # "cpu:gloo,cpu:gloo" (verl/utils/distributed.py) reaches torch as "cpu:gloo"
        import ps_bridge.compat.main_ppo_on_cpu as mod
        seen = {}
        torch.distributed.init_process_group = lambda *a, **k: seen.update(k)  # a stand-in for torch's
        mod._process_group_backend_for_cpu()
        torch.distributed.init_process_group(backend="cpu:gloo,cpu:gloo", rank=0, world_size=1)
        assert seen["backend"] == "cpu:gloo", seen
        # float32 passes verl's Megatron engine config
        from verl.workers.config import McoreEngineConfig
        assert McoreEngineConfig(dtype="float32").dtype == "float32"
        with __import__("pytest").raises(AssertionError):
            McoreEngineConfig(dtype="int8")
        # vLLM's CPU linear layers keep their weight: the stand-in records what vLLM's dispatch is asked
        import types
        calls = []
        fake_utils = types.ModuleType("fake_vllm_utils")
        fake_utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: calls.append(remove_weight)
        mod._vllm_cpu_linear_keeps_weights(fake_utils)
        fake_utils.dispatch_cpu_unquantized_gemm(object(), remove_weight=True)
        assert calls == [False]
        print("patched")
    """)
    assert "patched" in out


def test_vllm_cpu_answers_for_the_vllm_distribution():
    out = _run("""
        from ps_bridge.compat import main_ppo_on_cpu as m
        try:
            stock_version("vllm")
            has_vllm = True
        except importlib.metadata.PackageNotFoundError:
            has_vllm = False
        try:
            cpu = stock_version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            cpu = None
        m._vllm_cpu_distribution_version()
        if has_vllm or cpu is None:
            assert importlib.metadata.version is stock_version
        else:
            assert importlib.metadata.version("vllm") == cpu + "+cpu"
        assert importlib.metadata.version("torch") == stock_version("torch")
        print("ok")
    """)
    assert "ok" in out
