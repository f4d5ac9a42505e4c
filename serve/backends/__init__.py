"""Engine backends at serve time: each supplies its gates and the engine they end in."""

from __future__ import annotations

from serve.backends.base import Backend, EngineFault, Serving
from serve.gates import Evidence, GateFailure
from serve.stages import GateContext, Resolved

__all__ = ["Backend", "EngineFault", "Serving", "make_backend"]


def make_backend(ctx: GateContext, resolved: Resolved, ev: Evidence) -> Backend:
    """The backend the manifest names, built in gate 1 from what it resolved (imported on
    demand: trtllm pulls in TensorRT-LLM)."""
    name = resolved.manifest.backend
    if name in ("aoti", "eager"):
        from serve.backends.torch import TorchBackend

        return TorchBackend(ctx, resolved, ev)
    if name == "trtllm":
        from serve.backends.trtllm import TrtllmBackend

        return TrtllmBackend(ctx, resolved, ev)
    raise GateFailure("resolve", f"the engine's backend {name!r} cannot be served",
                      "rebuild it with --backend aoti, eager or trtllm")
