"""Contract fake of the `tensorrt` wheel: only its version (FAKE_TENSORRT_VERSION)."""

from __future__ import annotations

import os
from typing import Any


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return os.environ.get("FAKE_TENSORRT_VERSION", "10.13.0.35")
    raise AttributeError(f"module 'tensorrt' has no attribute {name!r}")
