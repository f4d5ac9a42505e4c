from __future__ import annotations

from .plugin import PluginConfig

__all__ = ["PluginConfig"]
