"""tensorrt_llm.models: the Llama family only, the one the reference documents."""

from __future__ import annotations

from .llama.model import LLAMA_FAMILY, LLaMAForCausalLM
from .modeling_utils import PretrainedConfig, PretrainedModel

# Checkpoint `architecture` -> model class, as trtllm-build looks it up.
MODEL_MAP: dict[str, type[PretrainedModel]] = dict.fromkeys(LLAMA_FAMILY, LLaMAForCausalLM)

__all__ = ["MODEL_MAP", "LLaMAForCausalLM", "PretrainedConfig"]
