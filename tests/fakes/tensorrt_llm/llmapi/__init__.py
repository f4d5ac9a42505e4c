from __future__ import annotations

from typing import Any

__all__ = ["BuildConfig"]


def __getattr__(name: str) -> Any:
    # Lazy: tensorrt_llm.builder imports llmapi.kv_cache_type, and this package re-exports
    # builder.BuildConfig.
    if name == "BuildConfig":
        from ..builder import BuildConfig

        return BuildConfig
    raise AttributeError(f"module 'tensorrt_llm.llmapi' has no attribute {name!r}")
