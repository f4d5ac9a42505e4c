from __future__ import annotations

from .model import LLaMAForCausalLM

__all__ = ["LLaMAForCausalLM"]
