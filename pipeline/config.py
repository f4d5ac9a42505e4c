"""Typed build configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.profile import BACKENDS, DTYPES, BuildProfile
from contract.quant import ALL_SCHEMES, INT4_GROUP_SIZES, SCHEMES, TRTLLM_ONLY_SCHEMES
from contract.speculative import Speculative


@dataclass(frozen=True, slots=True)
class BuildConfig:
    model: str  # as the user gave it: a directory, hf://org/name@rev, or a .gguf file
    tp: int = 1
    backend: str = "aoti"
    dtype: str = "bfloat16"
    target: str = "auto"  # auto | cpu | cuda | sm_XX (trtllm)
    profile: BuildProfile = field(default_factory=BuildProfile)
    store: str = "engines"
    quant: str = "none"  # none | int8_wo | int4_wo (| fp8, trtllm on an FP8 GPU)
    quant_group_size: int | None = None  # int4: 128 unless given; int8: per channel unless given
    quant_lm_head: str = "none"  # none | int8_wo | int4_wo: the LM head (and a tied embedding)
    # --speculative ngram[:K]: the drafter recorded in the manifest (contract/speculative.py).
    # The compiled step needs nothing more: a verify row is a prompt chunk of 1 + K tokens
    # with a logits row per token, within max_num_tokens like any chunk.
    speculative: Speculative | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"--tp must be at least 1, got {self.tp}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quant not in ALL_SCHEMES:
            raise ValueError(f"--quant must be one of {', '.join(ALL_SCHEMES)}, got {self.quant!r}")
        if self.quant in TRTLLM_ONLY_SCHEMES and self.backend != "trtllm":
            raise ValueError(f"--quant {self.quant} runs on TensorRT-LLM's kernels only: use "
                             "--backend trtllm on an sm_89 or newer GPU, or --quant int8_wo")
        if self.quant_lm_head not in SCHEMES:
            raise ValueError(f"--quant-lm-head must be one of {', '.join(SCHEMES)}, "
                             f"got {self.quant_lm_head!r}")
        if self.quant_group_size is not None and self.quant_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"--quant-group-size must be one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}, got {self.quant_group_size}")
        if self.speculative is not None and self.backend == "trtllm":
            raise ValueError("--speculative runs on the aoti and eager backends (our scheduler); "
                             "TensorRT-LLM engines configure their own")
        if (self.speculative is not None
                and self.speculative.num_tokens + 1 > self.profile.max_num_tokens):
            raise ValueError(f"--speculative {self.speculative}: 1 + K tokens exceed the step's "
                             f"--max-num-tokens ({self.profile.max_num_tokens})")
        if self.quant == "none" and (self.quant_group_size is not None or self.quant_lm_head != "none"):
            raise ValueError("--quant-group-size and --quant-lm-head need --quant int8_wo or int4_wo")
