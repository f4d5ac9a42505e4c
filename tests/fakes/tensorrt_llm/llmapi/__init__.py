from __future__ import annotations

from ..builder import BuildConfig

__all__ = ["BuildConfig"]
