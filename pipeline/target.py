"""Which target a build compiles for: what the user asked (--target) checked against this host."""

from __future__ import annotations

from contract.errors import BuildError
from contract.target import Target, normalize_sm
from runtime.host import SM_ENV, cuda_sm, gpu_sm, host_cpu_target


def detect_target(requested: str = "auto") -> Target:
    """auto | cpu | cuda | sm_XX -> the Target of this host; refuses what this host cannot build."""
    if requested == "cpu":
        return host_cpu_target()
    if requested in ("auto", "cuda") or requested.startswith("sm_"):
        sm = cuda_sm()
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


def trtllm_target(requested: str) -> Target:
    """The target of a TensorRT engine: TensorRT builds for the GPU it runs on."""
    if requested == "cpu":
        raise BuildError(
            "TensorRT-LLM engines run on NVIDIA GPUs only, not --target cpu",
            "use --target auto or sm_XX on the GPU host, or --backend aoti for a CPU engine",
        )
    have = gpu_sm()
    if requested.startswith("sm"):
        want = normalize_sm(requested)
        if want is None:
            raise BuildError(f"unknown --target {requested!r}", "give an SM such as sm_90")
        if have is not None and have != want:
            raise BuildError(
                f"--target {want} was requested but this host's GPU is {have}; TensorRT builds "
                "an engine for the GPU it runs on",
                f"build on a host with an {want} GPU, or use --target {have}",
            )
        return Target(device="cuda", sm=want)
    if requested not in ("auto", "cuda"):
        raise BuildError(f"unknown --target {requested!r}", "use auto, cuda or an SM such as sm_90")
    if have is None:
        raise BuildError(
            "cannot tell this host's GPU SM (torch sees no CUDA device)",
            f"pass --target sm_XX (the GPU's compute capability) or set {SM_ENV}",
        )
    return Target(device="cuda", sm=have)
