import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen2_checkpoint(tmp_path_factory):
    """A tiny random Qwen2 checkpoint on disk and the HF model it was saved from."""
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2

    path = tmp_path_factory.mktemp("qwen2")
    hf_model = build_tiny_qwen2(str(path))
    return str(path), hf_model


@pytest.fixture(scope="session")
def qwen2_loaded(qwen2_checkpoint):
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.tools.runtime import load_model

    path, _ = qwen2_checkpoint
    return load_model(path, PrefixSharingConfig(enabled=True, backend="torch_ref"))


@pytest.fixture(autouse=True)
def _fresh_moe_state():
    """megatron's MoE state is per process, the tests build many models in one: reset it after
    every test. The aux-loss backward outside its schedule (the tests' plain `.backward()`) leaves a
    0-dim `MoEAuxLossAutoScaler.main_loss_backward_scale`, into which a later schedule run cannot copy
    its [1]-shaped scale; the MoE metrics tracker sizes its per-layer entries by the first model's
    layer count."""
    yield
    import sys

    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if moe_logging is not None:
        moe_logging.destroy_moe_metrics_tracker()
