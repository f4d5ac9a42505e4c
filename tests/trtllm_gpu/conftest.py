"""The GPU-only TensorRT-LLM suite (`make test-trtllm`): runs only where torch sees an NVIDIA
GPU and a real TensorRT-LLM 1.2.x is importable; everywhere else each test is skipped with
the reason. It never uses the contract fake (tests/fakes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import REPO

FAKES = REPO / "tests" / "fakes"


def gpu_host_reason() -> str | None:
    """None on a host that can run the suite, else why not."""
    spec = importlib.util.find_spec("tensorrt_llm")
    if spec is None or spec.origin is None:
        return ("needs TensorRT-LLM 1.2.x (pip install -e '.[trtllm]' --extra-index-url "
                "https://pypi.nvidia.com on a host with an NVIDIA GPU); it is not installed here")
    if Path(spec.origin).resolve().is_relative_to(FAKES):
        return "tensorrt_llm here is the contract fake (tests/fakes), not TensorRT-LLM"
    import torch

    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU that torch can see (torch.cuda.is_available() is False)"
    return None


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="session")
def gpu_host() -> None:
    reason = gpu_host_reason()
    if reason is not None:
        pytest.skip(reason)
