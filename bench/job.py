"""One `serve launch` job for the soak and fault runs: start, watch, measure, clean up.

The job is started the way production runs it: `python -m serve launch` on its own (our
launcher, which starts `mpirun -n TP` itself). Every process of the job (launcher, mpirun,
the rank supervisors, the detached rank workers) carries the job's own `--run-dir` in its
command line, so "the whole job is gone" is checked, and leftovers are killed, by that
path: never by process name. The ranks write rank{N}.pid, rank{N}.log and rank{N}.exit
there (serve/worker.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO, free_port

HOST = "127.0.0.1"


def build_demo_engine(store: Path, tp: int, profile: Sequence[str], backend: str = "eager"
                      ) -> Path:
    """The SmolLM2-135M demo checkpoint built as a bf16 engine (a cache hit when built)."""
    env = child_env()
    out = subprocess.run([sys.executable, "-m", "demo.model"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=False, timeout=1800)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"python -m demo.model failed: {out.stderr.strip()[-800:]}")
    checkpoint = lines[-1].strip()
    cmd = [sys.executable, "-m", "pipeline", "build", checkpoint, "--tp", str(tp),
           "--backend", backend, "--dtype", "bfloat16", *profile, "--store", str(store)]
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False,
                         timeout=1800)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"pipeline build failed ({out.returncode}): "
                           f"{(out.stdout + out.stderr).strip()[-1500:]}")
    return Path(lines[-1].strip())


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, with this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{path}" if path else str(REPO)
    env.update(extra or {})
    return env


# ---- /proc ------------------------------------------------------------------------------


def _state(pid: int) -> str | None:
    """The state letter of a process, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def pids_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text` (a job's unique run directory)."""
    out = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        pid = int(entry.name) if entry.name.isdigit() else me
        if pid != me and text in cmdline(pid) and alive(pid):
            out.append(pid)
    return sorted(out)


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB (from /proc/<pid>/status), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


# ---- HTTP -------------------------------------------------------------------------------


def http(port: int, method: str, path: str, body: Any = None, timeout: float = 10.0
         ) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-case headers, body); status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, {}, b""


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text -> {(name, labels): value}; enough for our own page."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        with contextlib.suppress(ValueError):
            out[(m.group(1), labels)] = float(m.group(4))
    return out


def metric(page: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float | None:
    return page.get((name, frozenset(labels.items())))


def metric_sum(page: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str,
               **match: str) -> float:
    """Sum of every series of `name` whose labels include `match` (a value may be a regex)."""
    total = 0.0
    for (n, labels), value in page.items():
        if n != name:
            continue
        d = dict(labels)
        if all(k in d and re.fullmatch(v, d[k]) for k, v in match.items()):
            total += value
    return total


# ---- the job ----------------------------------------------------------------------------


@dataclass
class Job:
    proc: subprocess.Popen[bytes]
    port: int
    run_dir: Path
    workdir: Path
    tp: int
    started: float  # time.time() at launch
    exit_code: int | None = None
    gone_at: float | None = None  # time.time() when nothing of the job was left
    notes: list[str] = field(default_factory=list)

    # ---- files ---------------------------------------------------------------------

    @property
    def out_path(self) -> Path:
        return self.workdir / "stdout.log"

    @property
    def err_path(self) -> Path:
        return self.workdir / "stderr.log"

    def stderr(self) -> str:
        try:
            return self.err_path.read_text(errors="replace")
        except OSError:
            return ""

    def rank_log(self, rank: int) -> str:
        try:
            return (self.run_dir / f"rank{rank}.log").read_text(errors="replace")
        except OSError:
            return ""

    def run_file(self, rank: int, kind: str) -> int | None:
        try:
            return int((self.run_dir / f"rank{rank}.{kind}").read_text())
        except (OSError, ValueError):
            return None

    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of each rank's serving process, from rank{N}.pid (checked to be ours)."""
        out = {}
        for rank in range(self.tp):
            pid = self.run_file(rank, "pid")
            if pid is not None and str(self.run_dir) in cmdline(pid):
                out[rank] = pid
        return out

    def rss(self) -> dict[int, int | None]:
        """rank -> VmRSS (KiB) of its serving process."""
        return {rank: rss_kib(pid) for rank, pid in self.worker_pids().items()}

    # ---- HTTP ----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        status, _, body = http(self.port, "GET", path, timeout=timeout)
        if status == 0:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return None

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        status, _, body = http(self.port, "GET", "/metrics")
        return parse_metrics(body.decode()) if status == 200 else {}

    def running_gate(self) -> str | None:
        """The name of the gate rank 0 is in now (from /v1/engine), None if none/unknown."""
        report = self.get_json("/v1/engine", timeout=2.0)
        if not isinstance(report, dict):
            return None
        for gate in report.get("gates") or []:
            if gate.get("state") == "running":
                return str(gate.get("name"))
        return None

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Seconds from launch to the first 200 on /health/ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if http(self.port, "GET", "/health/ready", timeout=2.0)[0] == 200:
                return time.time() - self.started
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before ready:\n"
                                   f"{self.stderr()[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready within {timeout:.0f} s:\n"
                           f"{self.stderr()[-3000:]}")

    # ---- the end -------------------------------------------------------------------

    def left(self) -> list[int]:
        """Live processes of this job (anything naming its run directory as an argument)."""
        return pids_naming(f"{self.run_dir} ")

    def poll_gone(self) -> bool:
        if self.exit_code is None and self.proc.poll() is not None:
            self.exit_code = self.proc.returncode
        if self.gone_at is None and self.exit_code is not None and not self.left():
            self.gone_at = time.time()
        return self.gone_at is not None

    def wait_gone(self, timeout: float, poll_s: float = 0.02) -> bool:
        """True once the launcher has exited and no process of the job is alive."""
        deadline = time.monotonic() + timeout
        while not self.poll_gone():
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True

    def signal_launcher(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def kill_all(self) -> list[int]:
        """SIGKILL whatever of the job is still alive; returns those pids."""
        left = self.left()
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


def launch(engine: Path, workdir: Path, tp: int, args: Sequence[str] = (),
           env: Mapping[str, str] | None = None) -> Job:
    """`python -m serve launch --engine ENGINE --run-dir WORKDIR/run ...` in its own session."""
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = (workdir / "run").resolve()
    port = free_port()
    cmd = [sys.executable, "-m", "serve", "launch", "--engine", str(engine), "--host", HOST,
           "--port", str(port), "--run-dir", str(run_dir), *args]
    with (workdir / "stdout.log").open("wb") as out, (workdir / "stderr.log").open("wb") as err:
        err.write(f"$ {' '.join(cmd)}\n".encode())
        err.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(env), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Job(proc, port, run_dir, workdir, tp, time.time())
