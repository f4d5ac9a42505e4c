"""Knobs of the fake "machine", read from the environment at call time (never at import).

FAKE_TRTLLM_VERSION       TensorRT-LLM version this "install" reports (default 1.2.0)
FAKE_TENSORRT_VERSION     TensorRT version this "install" reports (default 10.13.0.35)
FAKE_TRTLLM_SM            compute capability of the fake GPU: "9.0", "90" or "sm_90" (default 9.0)
FAKE_TRTLLM_GPU_MEMORY_GIB  memory of the fake GPU in GiB (default 80)
FAKE_TRTLLM_TOY           "k,a,b": toy-model parameters chosen at checkpoint conversion
FAKE_TRTLLM_ITER_DELAY_MS   sleep per executor iteration, to make timing visible (default 0)
FAKE_TRTLLM_COLLECTIVE_TIMEOUT_S  fail a collective construction after this long (default 60)
FAKE_TRTLLM_AWAIT_LIMIT_S   fail an await_responses(timeout=None) blocked this long (default 120)
FAKE_TRTLLM_MPI           "singleton": TensorRT-LLM's MPI library was not started by this job's
                          mpirun (e.g. Open MPI 5's mpirun, Open MPI 4.1's libmpi), so every
                          process is a world of its own: rank 0 of 1 (default: the real world)
FAKE_TRTLLM_TRACE         a file the fake appends one JSON line to per observable event
                          ({"event": "import", "pid", "argv", "mpi"} when tensorrt_llm is
                          imported, "mpi" being "singleton" without a launcher,
                          {"event": "save_checkpoint", "pid", "dir"}): what a test learns of
                          the library's use in a child process it cannot patch (default: none)
"""

from __future__ import annotations

import json
import os
import re
import sys

DEFAULT_TRTLLM_VERSION = "1.2.0"
DEFAULT_TENSORRT_VERSION = "10.13.0.35"
DEFAULT_SM = "9.0"


def trtllm_version() -> str:
    return os.environ.get("FAKE_TRTLLM_VERSION", DEFAULT_TRTLLM_VERSION)


def tensorrt_version() -> str:
    return os.environ.get("FAKE_TENSORRT_VERSION", DEFAULT_TENSORRT_VERSION)


def device_sm() -> str:
    """The fake GPU's compute capability as "major.minor" (the form TensorRT's errors use)."""
    raw = os.environ.get("FAKE_TRTLLM_SM", DEFAULT_SM).strip().lower()
    m = re.fullmatch(r"(?:sm_?)?(\d+)\.?(\d)", raw)
    if m is None:
        raise ValueError(f"FAKE_TRTLLM_SM={raw!r}: expected e.g. 9.0, 90 or sm_90")
    return f"{int(m.group(1))}.{m.group(2)}"


def gpu_memory_bytes() -> int:
    return int(float(os.environ.get("FAKE_TRTLLM_GPU_MEMORY_GIB", "80")) * 2**30)


def toy_override() -> tuple[int, int, int] | None:
    raw = os.environ.get("FAKE_TRTLLM_TOY")
    if not raw:
        return None
    parts = [int(p) for p in raw.split(",")]
    if len(parts) != 3 or parts[0] < 1:
        raise ValueError(f"FAKE_TRTLLM_TOY={raw!r}: expected 'k,a,b' with k >= 1")
    return parts[0], parts[1], parts[2]


def iter_delay_s() -> float:
    return float(os.environ.get("FAKE_TRTLLM_ITER_DELAY_MS", "0")) / 1000.0


def collective_timeout_s() -> float:
    return float(os.environ.get("FAKE_TRTLLM_COLLECTIVE_TIMEOUT_S", "60"))


def await_limit_s() -> float:
    return float(os.environ.get("FAKE_TRTLLM_AWAIT_LIMIT_S", "120"))


def mpi_singleton() -> bool:
    """Every process sees an MPI world of one, whatever mpirun started (FAKE_TRTLLM_MPI)."""
    raw = os.environ.get("FAKE_TRTLLM_MPI", "").strip().lower()
    if raw not in ("", "singleton"):
        raise ValueError(f"FAKE_TRTLLM_MPI={raw!r}: expected 'singleton' or nothing")
    return raw == "singleton"


def log(level: str, msg: str) -> None:
    """TensorRT-LLM's logger format; the real library logs to stderr/stdout, not warnings."""
    print(f"[TensorRT-LLM][{level}] {msg}", file=sys.stderr, flush=True)


def trt_log_error(code: int, msg: str) -> None:
    """TensorRT's own error log line, as users see it: `[TRT] [E] 6: ...`."""
    print(f"[TRT] [E] {code}: {msg}", file=sys.stderr, flush=True)


def trace(event: str, **fields: object) -> None:
    """Append {"event", "pid", **fields} to FAKE_TRTLLM_TRACE, when set (one write: lines from
    several processes do not interleave)."""
    path = os.environ.get("FAKE_TRTLLM_TRACE")
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
