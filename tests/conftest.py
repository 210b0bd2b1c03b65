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
    from ps_bridge.tiny_checkpoints import build_tiny_qwen2

    path = tmp_path_factory.mktemp("qwen2")
    hf_model = build_tiny_qwen2(str(path))
    return str(path), hf_model


@pytest.fixture(scope="session")
def qwen2_loaded(qwen2_checkpoint):
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.runtime import load_model

    path, _ = qwen2_checkpoint
    return load_model(path, PrefixSharingConfig(enabled=True, backend="torch_ref"))
