"""The device an engine is built for, detected on the build host and checked on the serve host.

A CPU engine records the architecture and the best vector ISA the compiler may use; a CUDA
engine records the SM. AOTInductor bakes that choice into the generated kernels, so an
avx512 engine must not be loaded on an avx2-only host.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import BuildError

# Ordered from weakest to strongest: a host runs engines built for its level or any below.
ISA_LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
# /proc/cpuinfo flags each level needs (cumulative with the levels below it).
_ISA_FLAGS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512_bf16"},
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


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        # x86 says "flags", arm64 says "Features"; the first processor is representative.
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_isa_level(flags: set[str]) -> str:
    level = "baseline"
    for name in ISA_LEVELS[1:]:
        if not _ISA_FLAGS[name] <= flags:
            break
        level = name
    return level


def host_cpu_target() -> Target:
    arch = platform.machine() or "unknown"
    isa = cpu_isa_level(cpu_flags()) if arch in ("x86_64", "AMD64") else "baseline"
    return Target(device="cpu", arch=arch, isa=isa)


def _cuda_sm() -> str | None:
    """The SM of the first visible GPU, or None when CUDA is absent."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm_{major}{minor}"


def detect_target(requested: str = "auto") -> Target:
    """auto | cpu | cuda | sm_XX -> the Target of this host; refuses what this host cannot build."""
    if requested == "cpu":
        return host_cpu_target()
    if requested in ("auto", "cuda") or requested.startswith("sm_"):
        sm = _cuda_sm()
        if sm is None:
            if requested == "auto":
                return host_cpu_target()
            raise BuildError(
                f"--target {requested} was requested but no CUDA device is visible on this host",
                "use --target cpu, or build on the GPU host the engine will run on",
            )
        if requested.startswith("sm_") and requested != sm:
            raise BuildError(
                f"--target {requested} was requested but the visible GPU is {sm}",
                f"build on a host with an {requested} GPU, or use --target cuda for {sm}",
            )
        return Target(device="cuda", sm=sm)
    raise BuildError(
        f"unknown --target {requested!r}", "use one of auto, cpu, cuda, or an SM such as sm_90"
    )


def host_matches(recorded: dict[str, str]) -> tuple[bool, str]:
    """Whether an engine built for ``recorded`` (a Target dict) can run here, and why not."""
    try:
        want = Target.from_dict(recorded)
    except (KeyError, ValueError, TypeError) as e:
        return False, f"the manifest's target {recorded!r} is not understood ({e})"
    if want.device == "cuda":
        have = _cuda_sm()
        if have is None:
            return False, f"the engine was built for {want.sm} but no CUDA device is visible"
        # Compiled cubins are specific to one SM; no forward compatibility is assumed.
        if have != want.sm:
            return False, f"the engine was built for {want.sm} but this GPU is {have}"
        return True, f"GPU {have} matches"
    host = host_cpu_target()
    if want.arch and want.arch != host.arch:
        return False, f"the engine was built for {want.arch} but this host is {host.arch}"
    want_isa = want.isa or "baseline"
    if ISA_LEVELS.index(host.isa or "baseline") < ISA_LEVELS.index(want_isa):
        return False, (
            f"the engine was compiled for {want_isa} but this CPU only supports {host.isa}; "
            "rebuild the engine on this host"
        )
    return True, f"CPU {host.arch} {host.isa} covers the engine's {want_isa}"
