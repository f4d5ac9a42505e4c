"""tensorrt_llm.llmapi.kv_cache_type.KVCacheType: the KV cache kind of a BuildConfig.

A `str` enum whose lookup ignores case (`KVCacheType("PAGED") is KVCacheType.PAGED`), as in
TensorRT-LLM 1.2. Earlier 1.x releases used the C++ bindings enum in a dataclass BuildConfig,
where the string "paged" is not equal to the enum and silently disables the paged cache.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["KVCacheType"]


class KVCacheType(str, Enum):
    CONTINUOUS = "continuous"
    PAGED = "paged"
    DISABLED = "disabled"

    @classmethod
    def _missing_(cls, value: object) -> KVCacheType | None:
        if isinstance(value, str):
            wanted = value.lower()
            return next((m for m in cls if m.value == wanted), None)
        return None
