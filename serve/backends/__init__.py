"""Engine backends at serve time: each supplies the gate bodies and the serving executor."""

from __future__ import annotations

from typing import TYPE_CHECKING

from serve.backends.base import Backend, EngineFault
from serve.gates import GateFailure

if TYPE_CHECKING:
    from serve.startup import Startup

__all__ = ["Backend", "EngineFault", "make_backend"]


def make_backend(name: str, st: Startup) -> Backend:
    """The backend the manifest names (imported on demand: trtllm pulls in TensorRT-LLM)."""
    if name in ("aoti", "eager"):
        from serve.backends.torch import TorchBackend

        return TorchBackend(st)
    if name == "trtllm":
        from serve.backends.trtllm import TrtllmBackend

        return TrtllmBackend(st)
    raise GateFailure("resolve", f"the engine's backend {name!r} cannot be served",
                      "rebuild it with --backend aoti, eager or trtllm")
