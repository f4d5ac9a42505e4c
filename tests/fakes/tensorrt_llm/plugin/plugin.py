"""tensorrt_llm.plugin.plugin.PluginConfig: the pydantic plugin settings (reference §1.2).

Unknown keys are ignored, as TensorRT-LLM's PluginConfig ignores them: a misspelt plugin name
is dropped without a word, so callers must read back what they set.

Reading a field set to "auto" returns the config's `dtype`, not "auto", as the real one does
(`tensorrt_llm/plugin/plugin.py` at 1.2.0rc2, `PluginConfig.__getattribute__`: `if name !=
"dtype" and value == "auto": return self.dtype`); the stored value (model_dump, config.json)
stays "auto". A read-back that expects "auto" therefore sees "float16" or "bfloat16".
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

# Precision plugins take a dtype, "auto", or "disable" (stored as None = off).
_PLUGIN_DTYPES = {"auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4"}


class PluginConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_assignment=True)

    dtype: str = "float16"  # the model's dtype; build() sets it from the model
    gemm_plugin: str | None = None  # default off; docs recommend "auto" for FP16/BF16
    gpt_attention_plugin: str | None = "auto"  # auto = the model dtype
    nccl_plugin: str | None = "auto"
    context_fmha: bool = True
    remove_input_padding: bool = True
    use_paged_context_fmha: bool = True  # pydantic 1.x default; chunked context needs it
    multiple_profiles: bool = False
    tokens_per_block: int = 32
    reduce_fusion: bool = False
    use_fused_mlp: bool = True

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if name != "dtype" and isinstance(value, str) and value == "auto":
            return super().__getattribute__("dtype")
        return value

    @field_validator("gemm_plugin", "gpt_attention_plugin", "nccl_plugin", mode="before")
    @classmethod
    def _precision(cls, v: str | None) -> str | None:
        if v is None or v == "disable":
            return None
        if v not in _PLUGIN_DTYPES:
            raise ValueError(f"plugin dtype must be one of {sorted(_PLUGIN_DTYPES)} or disable")
        return v

    @field_validator("tokens_per_block")
    @classmethod
    def _tpb(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("tokens_per_block must be positive")
        return v
