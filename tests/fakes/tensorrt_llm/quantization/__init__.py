"""tensorrt_llm.quantization: QuantAlgo, the `quantization.quant_algo` values (§1.1).

The names are those convert_checkpoint.py's flags set (`--use_weight_only
--weight_only_precision int8|int4` -> W8A16 | W4A16, `--use_fp8` -> FP8); a StrEnum, so the
checkpoint's config.json holds the plain name.
"""

from __future__ import annotations

from enum import Enum


class QuantAlgo(str, Enum):
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    W4A16_AWQ = "W4A16_AWQ"
    W4A16_GPTQ = "W4A16_GPTQ"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"
    FP8 = "FP8"
    NVFP4 = "NVFP4"
    NO_QUANT = "NO_QUANT"

    def __str__(self) -> str:
        return self.value


# What from_hugging_face quantizes by itself while loading (weight-only, and FP8 from the
# weights' own ranges); the others need calibration data (LLaMAForCausalLM.quantize).
LOAD_TIME_ALGOS = (QuantAlgo.W8A16, QuantAlgo.W4A16, QuantAlgo.FP8)
FP8_MIN_SM = 89

__all__ = ["QuantAlgo"]  # the constants above are the fake's own
