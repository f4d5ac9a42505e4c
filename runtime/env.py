"""Every environment variable the project reads, in one registry, and typed accessors.

Code reads `AOTLLM_*`, `AOT_LLM_CACHE` and `BENCH_HF_DIR` through these entries, never by a
literal name, so this file is the whole list: docs/design.md §8 is its table
(`markdown_table()` writes it; tests/unit/test_env.py checks the two agree and that the
source names no variable missing here). contract/ reads no environment at all: what
it needs (the engine cache's root) comes from here, through its callers.

Scopes: `user` is set by whoever runs a command; `test` injects faults or delays for the
tests and the bench; `internal` is set by one of our processes for a child it starts
(serve/supervisor.py for its worker), never by hand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Scope = Literal["user", "test", "internal"]
# A flag is on unless it says one of these (so "1", "yes" and "true" all turn one on).
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    kind: str  # what the value is, for the docs: "flag", "seconds", "path", ...
    default: str | None  # what unset means, as text; None: nothing (the feature is off)
    meaning: str
    read_by: str  # the module that reads it
    scope: Scope = "user"

    def raw(self) -> str | None:
        """The value, stripped; None when unset or empty."""
        value = os.environ.get(self.name, "").strip()
        return value or None


API_KEY = EnvVar(
    "AOTLLM_API_KEY", "text", None,
    "the bearer key `/v1/*` requires when `serve launch --api-key` is not given; only rank 0 "
    "reads it, and the launcher does not forward it to other hosts", "serve/launch.py")
BINDING = EnvVar(
    "AOTLLM_BINDING", "JSON", None,
    "the CPU binding the supervisor widened before starting its worker, for the worker's "
    "gate evidence", "serve/cores.py", "internal")
BOOT_SOCK = EnvVar(
    "AOTLLM_BOOT_SOCK", "fd", None,
    "the socket over which the supervisor hands its worker the MPI bootstrap and rank 0's "
    "listening sockets; unset, the worker is a single rank without mpirun",
    "serve/worker.py", "internal")
CPU_ISA = EnvVar(
    "AOTLLM_CPU_ISA", "ISA level", None,
    "caps this process's CPU ISA level (baseline, avx2, avx512, avx512_bf16, amx): builds "
    "compile for it, the compatible gate checks against it, ATen and oneDNN are held to it "
    "(runtime/__init__.py); unset, the host's own level", "runtime/host.py")
GC_FREEZE = EnvVar(
    "AOTLLM_GC_FREEZE", "flag", "1",
    "0: the collector runs during start-up and the heap is not frozen at admission "
    "(an escape hatch, and the bench's A/B)", "serve/gcpolicy.py")
GOLDEN_TIMEOUT = EnvVar(
    "AOTLLM_GOLDEN_TIMEOUT_S", "seconds", "900",
    "the time limit of a trtllm build's golden run; past it the run's process group is "
    "ended and the build fails naming the golden stage", "pipeline/compile/trtllm.py")
GPU_SM = EnvVar(
    "AOTLLM_GPU_SM", "SM", None,
    "the GPU's SM (sm_90 or 9.0) when torch cannot query the GPU itself (a CPU-only torch "
    "beside TensorRT-LLM, the tests' fake)", "runtime/host.py")
INJECT_FAULT_AT_STEP = EnvVar(
    "AOTLLM_INJECT_FAULT_AT_STEP", "step", None,
    "the torch engine loop raises at this step (fault tests, bench/faults.py)",
    "serve/backends/torch.py", "test")
INJECT_GATE_DELAY = EnvVar(
    "AOTLLM_INJECT_GATE_DELAY", "GATE:SECONDS,...", None,
    "holds every rank at the start of those gates (a stop signal ends a hold), so a signal "
    "or probe lands while start-up is in progress", "serve/startup.py", "test")
INJECT_GATE_HOLD = EnvVar(
    "AOTLLM_INJECT_GATE_HOLD", "GATE:DIR", None,
    "holds every rank inside that gate (running, before its body) until DIR/release exists "
    "or a stop signal arrives; each rank writes DIR/held.rank{N} when held, so a fault lands "
    "in the gate it names on any machine (bench/faults.py)", "serve/startup.py", "test")
KEEP_BINDING = EnvVar(
    "AOTLLM_KEEP_BINDING", "flag", "0",
    "1: keep a CPU binding mpirun gave a rank instead of widening it to the rank's share of "
    "the host's cores", "serve/cores.py")
LAUNCH_TIME = EnvVar(
    "AOTLLM_LAUNCH_TIME", "Unix time", None,
    "when the supervisor started, so the gate timeline counts from the launch",
    "serve/gates.py", "internal")
MPIRUN = EnvVar(
    "AOTLLM_MPIRUN", "path", None,
    "the mpirun that starts ranks (serve launch, the golden run of a TP build); "
    "`--mpirun` sets it; unset, the mpirun of the MPI library mpi4py loads", "runtime/dist/mpi.py")
PARENT_FD = EnvVar(
    "AOTLLM_PARENT_FD", "fd", None,
    "a pipe's read end the worker watches: EOF means its supervisor is gone",
    "serve/worker.py", "internal")
PEER_TIMEOUT = EnvVar(
    "AOTLLM_PEER_TIMEOUT_S", "seconds", "4",
    "a peer rank without an acknowledgement or keepalive reply this long is declared dead",
    "runtime/dist/bootstrap.py")
RENDEZVOUS = EnvVar(
    "AOTLLM_RENDEZVOUS", "mpi", None,
    "mpi: the ranks of several hosts meet by an MPI broadcast instead of the MPI runtime's "
    "name service (an MPI without one)", "runtime/dist/bootstrap.py")
STORE_DEADLINE = EnvVar(
    "AOTLLM_STORE_DEADLINE_S", "seconds", "30",
    "how long one engine-store operation (with its retries) may take, at least 1 s; "
    "`pipeline push/pull` use it, `serve launch` takes `--store-deadline` instead",
    "runtime/store/objstore.py")
THP = EnvVar(
    "AOTLLM_THP", "flag", "1",
    "0: shard buffers on 4 KiB pages instead of transparent huge pages", "runtime/store/loader.py")
THREADS = EnvVar(
    "AOTLLM_THREADS", "count", None,
    "each rank's intra-op threads, in place of its plan (its share of its cores, capped by "
    "a cgroup CPU quota)", "serve/threads.py")
CACHE = EnvVar(
    "AOT_LLM_CACHE", "path", "~/.cache/aot-llm",
    "the local cache: downloaded checkpoints, compiled kernels, pulled engines (engines/), "
    "the bench's peers (peers/)", "runtime/env.py")
BENCH_HF_DIR = EnvVar(
    "BENCH_HF_DIR", "path", None,
    "the bench's Hugging Face checkpoint; unset, `python -m demo.model`'s",
    "bench/common.py")

REGISTRY: tuple[EnvVar, ...] = (
    API_KEY, BINDING, BOOT_SOCK, CPU_ISA, GC_FREEZE, GOLDEN_TIMEOUT, GPU_SM,
    INJECT_FAULT_AT_STEP, INJECT_GATE_DELAY, INJECT_GATE_HOLD, KEEP_BINDING, LAUNCH_TIME,
    MPIRUN, PARENT_FD,
    PEER_TIMEOUT, RENDEZVOUS, STORE_DEADLINE, THP, THREADS, CACHE, BENCH_HF_DIR,
)


def text(var: EnvVar) -> str | None:
    """The variable's value, or its default; None when neither."""
    return var.raw() or var.default


def flag(var: EnvVar) -> bool:
    value = text(var)
    return value is not None and value.lower() not in _OFF


def number(var: EnvVar) -> float:
    """The value (or default) as a number; ValueError naming the variable when it is not."""
    value = text(var)
    if value is None:
        raise ValueError(f"{var.name} is not set and has no default")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{var.name}={value!r} is not a number") from None


def count(var: EnvVar) -> int | None:
    """The value as a whole number of at least 1, or None when unset; ValueError naming the
    variable when it is anything else."""
    value = var.raw()
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{var.name}={value!r}: give a whole number, 1 or more")
    return int(value)


def cache_root() -> Path:
    """$AOT_LLM_CACHE, or ~/.cache/aot-llm."""
    value = text(CACHE)
    assert value is not None  # CACHE has a default
    return Path(value).expanduser()


def markdown_table() -> str:
    """The registry as docs/design.md §8's table."""
    rows = ["| variable | value | default | scope | read by | meaning |",
            "|---|---|---|---|---|---|"]
    for v in REGISTRY:
        default = f"`{v.default}`" if v.default is not None else "unset"
        rows.append(f"| `{v.name}` | {v.kind} | {default} | {v.scope} | `{v.read_by}` "
                    f"| {v.meaning} |")
    return "\n".join(rows)
