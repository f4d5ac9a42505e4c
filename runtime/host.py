"""What this host is: its CPU ISA level and its GPU's SM, and whether it can run an engine.

The build records a Target (contract/target.py); the serve `compatible` gate asks
`host_matches` whether this host can run it.
"""

from __future__ import annotations

import platform
from pathlib import Path

from contract.target import ISA_LEVELS, Target, cpu_isa_level, normalize_sm
from runtime.env import CPU_ISA, GPU_SM

# A cap on the CPU ISA level this process uses (one of ISA_LEVELS): builds compile for it,
# the compatible gate checks against it, and ATen and oneDNN are held to it (runtime/__init__
# sets isa_env's variables before torch runs an op), so that every kernel path of a weaker
# target is built and tested on a stronger host. Unset: the host's own level.
ISA_ENV = CPU_ISA.name
# What ATen (its vectorised kernels, and Inductor's code) and oneDNN are told for each level.
_ATEN_CAPABILITY = {"baseline": "default", "avx2": "avx2", "avx512": "avx512",
                    "avx512_bf16": "avx512", "amx": "avx512"}
_ONEDNN_ISA = {"baseline": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE",
               "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX"}

# Only consulted when torch cannot query the GPU itself (a CPU-only torch beside TensorRT-LLM,
# or the test suite's contract fake, which has no CUDA): the GPU's SM, e.g. sm_90 or 9.0.
SM_ENV = GPU_SM.name


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


def isa_cap() -> str | None:
    """The level AOTLLM_CPU_ISA caps this process at, or None; ValueError when unknown."""
    raw = CPU_ISA.raw()
    if not raw:
        return None
    if raw not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={raw!r} is not a CPU ISA level; use one of "
                         f"{', '.join(ISA_LEVELS)}")
    return raw


def isa_env(level: str) -> dict[str, str]:
    """The environment that holds a process (ours, ATen, oneDNN) to ISA `level`."""
    if level not in ISA_LEVELS:
        raise ValueError(f"unknown CPU ISA level {level!r}; known: {', '.join(ISA_LEVELS)}")
    return {ISA_ENV: level, "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY[level],
            "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[level]}


def host_cpu_target() -> Target:
    """This host's CPU target: its strongest ISA level, or AOTLLM_CPU_ISA's if lower."""
    arch = platform.machine() or "unknown"
    if arch not in ("x86_64", "AMD64"):
        return Target(device="cpu", arch=arch, isa="baseline")
    isa = cpu_isa_level(cpu_flags())
    cap = isa_cap()
    if cap is not None and ISA_LEVELS.index(cap) < ISA_LEVELS.index(isa):
        isa = cap
    return Target(device="cpu", arch=arch, isa=isa)


def cuda_sm() -> str | None:
    """The SM of the first visible GPU, or None when CUDA is absent."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm_{major}{minor}"


def gpu_sm() -> str | None:
    """The SM of the GPU this process would use: torch's CUDA first, then AOTLLM_GPU_SM."""
    sm = cuda_sm()
    if sm is not None:
        return sm
    raw = GPU_SM.raw()
    return normalize_sm(raw) if raw else None


def host_matches(recorded: dict[str, str]) -> tuple[bool, str]:
    """Whether an engine built for ``recorded`` (a Target dict) can run here, and why not."""
    try:
        want = Target.from_dict(recorded)
    except (KeyError, ValueError, TypeError) as e:
        return False, f"the manifest's target {recorded!r} is not understood ({e})"
    if want.device == "cuda":
        have = cuda_sm()
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
