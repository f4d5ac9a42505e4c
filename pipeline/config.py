"""Typed build configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.profile import BACKENDS, DTYPES, BuildProfile


@dataclass(frozen=True, slots=True)
class BuildConfig:
    model: str  # as the user gave it: a directory, hf://org/name@rev, or a .gguf file
    tp: int = 1
    backend: str = "aoti"
    dtype: str = "bfloat16"
    target: str = "auto"  # auto | cpu | cuda | sm_XX (trtllm)
    profile: BuildProfile = field(default_factory=BuildProfile)
    store: str = "engines"

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"--tp must be at least 1, got {self.tp}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
