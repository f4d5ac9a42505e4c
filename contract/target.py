"""The device an engine is built for, as recorded in its manifest.

A CPU engine records the architecture and the best vector ISA the compiler may use; a CUDA
engine records the SM. AOTInductor bakes that choice into the generated kernels, so an
avx512 engine must not be loaded on an avx2-only host (runtime/host.py checks that).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

# Ordered from weakest to strongest: a host runs engines built for its level or any below.
ISA_LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
# /proc/cpuinfo flags each level needs (cumulative with the levels below it).
ISA_FLAGS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    # every CPU with a bf16 dot product has VNNI (the pair panels' int16 dot product)
    "avx512_bf16": {"avx512_bf16", "avx512_vnni"},
    "amx": {"amx_tile", "amx_bf16"},
}
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class Target:
    device: str  # "cpu" | "cuda"
    arch: str | None = None  # cpu: platform.machine(), e.g. "x86_64"
    isa: str | None = None  # cpu: one of ISA_LEVELS
    sm: str | None = None  # cuda: e.g. "sm_90"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(
                f"target device must be one of {', '.join(DEVICES)}, got {self.device!r}"
            )
        if self.device == "cpu" and self.isa is not None and self.isa not in ISA_LEVELS:
            raise ValueError(f"unknown CPU ISA level {self.isa!r}; known: {', '.join(ISA_LEVELS)}")
        if self.device == "cuda" and not (self.sm and self.sm.startswith("sm_")):
            raise ValueError(f"a cuda target needs an SM such as 'sm_90', got {self.sm!r}")

    def to_dict(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, str]) -> Target:
        return cls(device=d["device"], arch=d.get("arch"), isa=d.get("isa"), sm=d.get("sm"))

    def __str__(self) -> str:
        if self.device == "cuda":
            return f"cuda {self.sm}"
        return f"cpu {self.arch} {self.isa}"


def cpu_isa_level(flags: set[str]) -> str:
    """The strongest ISA level whose flags (and every weaker level's) are all present."""
    level = "baseline"
    for name in ISA_LEVELS[1:]:
        if not ISA_FLAGS[name] <= flags:
            break
        level = name
    return level


def normalize_sm(raw: str) -> str | None:
    """'sm_90', 'sm90', '90' or '9.0' -> 'sm_90'; None when it is not an SM."""
    m = re.fullmatch(r"(?:sm_?)?(\d+)\.?(\d)", raw.strip().lower())
    return f"sm_{int(m.group(1))}{m.group(2)}" if m else None
