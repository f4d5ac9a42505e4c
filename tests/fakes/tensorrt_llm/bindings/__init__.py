"""tensorrt_llm.bindings: the C++ bindings; the fake provides the `executor` submodule."""

from __future__ import annotations

from . import executor

__all__ = ["executor"]
