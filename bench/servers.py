"""Start and stop each served system as a subprocess, timing launch to ready.

Each server runs in its own session (process group), so stopping it kills everything it
spawned (mpirun's ranks, vLLM's engine core) and nothing is left behind, even when the
benchmark fails half way.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.common import REPO, cmdline, llama_server_bin, session_stats, vllm_python
from serve.cores import KEEP_BINDING_ENV


@dataclass(frozen=True)
class ServerSpec:
    name: str  # label in the report, e.g. "ours-tp1", "llama-server"
    argv: tuple[str, ...]
    port: int
    ready_path: str  # GET answering 200 once the server takes traffic
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("argv must not be empty")
        if not 1024 <= self.port <= 65535:
            raise ValueError(f"port must be in [1024, 65535], got {self.port}")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> str:
        prefix = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{prefix} {cmdline(list(self.argv))}".strip()


@dataclass
class Running:
    spec: ServerSpec
    proc: subprocess.Popen[bytes]
    ready_s: float  # wall time from Popen to the first 200 on ready_path
    log_path: Path


def ours_spec(
    engine_dir: Path, port: int, tp: int = 1, warmup: str = "auto", name: str | None = None
) -> ServerSpec:
    from runtime.dist.mpi import mpirun_argv  # the project's own flags (--bind-to none on CPU)

    argv = (
        *mpirun_argv(tp), str(REPO / ".venv" / "bin" / "python"), "-m", "serve", "launch",
        "--engine", str(engine_dir), "--port", str(port), "--warmup", warmup,
    )  # fmt: skip
    return ServerSpec(name or f"ours-tp{tp}", argv, port, "/health/ready")


def llama_spec(gguf: Path, port: int, parallel: int = 16, ctx_per_slot: int = 512,
               repack: bool = True, threads: int = 2) -> ServerSpec:
    """`repack` False: llama.cpp keeps the file's blocks as they are (--no-repack) instead of
    repacking them for its CPU kernels (AMX's, where the CPU has it)."""
    # -c is the total context, split evenly across the -np slots.
    argv = (
        str(llama_server_bin()), "-m", str(gguf), "-np", str(parallel), "-t", str(threads),
        "-tb", str(threads),
        "-c", str(parallel * ctx_per_slot), "--host", "127.0.0.1", "--port", str(port),
        *(() if repack else ("--no-repack",)),
    )  # fmt: skip
    return ServerSpec("llama-server", argv, port, "/health")


def vllm_spec(
    hf_dir: Path, port: int, cache_root: Path, kv_gib: int = 2, max_model_len: int = 512
) -> ServerSpec:
    """vLLM for CPU; `cache_root` (VLLM_CACHE_ROOT) empty means a true cold start: vLLM
    compiles its graphs before ready and would otherwise reuse an earlier start's."""
    argv = (
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
        "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", hf_dir.name,
    )  # fmt: skip
    # OpenMP threads on every core, as llama-server's -t 2 and our ranks get on this machine.
    cores = f"0-{(os.cpu_count() or 1) - 1}"
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": cores,
           "VLLM_CACHE_ROOT": str(cache_root)}  # fmt: skip
    return ServerSpec("vllm", argv, port, "/health", env=env, ready_timeout_s=900.0)


def pinned(spec: ServerSpec, cores: set[int]) -> ServerSpec:
    """The server confined to `cores` (taskset): our ranks size their threads by the cores
    they may use (serve/threads.py) and keep the binding instead of widening it to their
    launcher's (serve/cores.py); llama-server is given its -t by the caller."""
    return replace(spec, argv=("taskset", "-c", ",".join(map(str, sorted(cores))), *spec.argv),
                   env={**spec.env, KEEP_BINDING_ENV: "1"})


CPU_V1 = Path("/sys/fs/cgroup/cpu")  # the v1 cpu controller, as on this workplace's machines


@contextmanager
def cpu_quota_cgroup(cores: float, name: str) -> Iterator[tuple[str, ...]]:
    """A cgroup v1 with a CFS quota of `cores` (a pod's CPU limit: 150000 us of CPU every
    100000 us for 1.5 cores), removed afterwards; yields the argv prefix that runs a command
    inside it (every process the command starts stays in it). Needs root."""
    if not (CPU_V1 / "cpu.cfs_quota_us").exists():
        raise RuntimeError(f"no cgroup v1 cpu controller at {CPU_V1}: cannot set a CPU quota")
    d = CPU_V1 / f"aotllm-bench-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{os.getpid()}"
    d.mkdir(exist_ok=True)
    period = int((d / "cpu.cfs_period_us").read_text())
    (d / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
    try:
        yield ("sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh")
    finally:
        for _ in range(100):  # the killed process group leaves the cgroup as it is reaped
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def in_cgroup(spec: ServerSpec, prefix: tuple[str, ...]) -> ServerSpec:
    return replace(spec, argv=(*prefix, *spec.argv))


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """Status and body of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


def get_json(url: str, timeout: float = 5.0) -> dict[str, Any] | None:
    status, body = http_get(url, timeout)
    if status != 200:
        return None
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> list[int]:
    """SIGTERM the server's process group (mpirun forwards it to its ranks), then SIGKILL
    everything left in its session. Returns the pids that had to be killed."""
    sid = proc.pid  # start_new_session=True: the server leads its own session
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        if not _alive(sid):
            return []
        time.sleep(0.1)
    killed = _alive(sid)
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)
    return killed


def _alive(sid: int) -> list[int]:
    return sorted(pid for pid, st in session_stats(sid).items() if st[0] != "Z")  # Z: zombie


@contextmanager
def serve(spec: ServerSpec, log_dir: Path, poll_s: float = 0.05) -> Iterator[Running]:
    """Launch, wait for ready (timed from launch), yield, and always kill the process group."""
    if http_get(f"{spec.base_url}{spec.ready_path}", timeout=1.0)[0] != 0:
        raise RuntimeError(f"port {spec.port} already answers; refusing to start {spec.name}")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    from runtime.dist.mpi import mpi_session  # a session directory of its own for mpirun

    with mpi_session({**os.environ, **spec.env}) as env:
        with open(log_path, "ab") as log:
            log.write(f"$ {spec.command}\n".encode())
            log.flush()
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                list(spec.argv), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip
        try:
            url = f"{spec.base_url}{spec.ready_path}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{spec.name} exited with {proc.returncode} before ready; "
                        f"last log lines:\n{tail(log_path)}"
                    )
                if http_get(url, timeout=2.0)[0] == 200:
                    break
                if time.perf_counter() - t0 > spec.ready_timeout_s:
                    raise RuntimeError(f"{spec.name} not ready after {spec.ready_timeout_s:.0f} s")
                time.sleep(poll_s)
            yield Running(spec, proc, time.perf_counter() - t0, log_path)
        finally:
            killed = stop(proc)
            if killed:
                print(f"{spec.name}: did not exit on SIGTERM; killed {killed}", flush=True)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
