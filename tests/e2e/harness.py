"""Launching `mpirun -n N python -m serve launch` for the end-to-end tests, and cleaning up.

Each rank is a thin supervisor whose real worker runs detached in its own session (see
serve/supervisor.py), so neither killing mpirun's process group nor waiting for mpirun
accounts for the workers: the run directory (`--run-dir`) holds each worker's pid and, at
exit, its exit code, and teardown kills exactly the processes this launch started (found
by their parent links and by the run directory in their command line, never by name).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from bench.job import alive, cmdline
from runtime.dist.mpi import mpi_session, mpirun_argv
from tests.conftest import REPO, subprocess_env

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Probe:
    """One look at the server while it starts: statuses are None when nothing answered."""

    t: float  # seconds since launch
    live: int | None
    ready: int | None
    ready_headers: dict[str, str] = field(default_factory=dict)
    ready_body: Any = None


# Ports below the kernel's ephemeral range (32768-60999 here), shuffled once per process.
# A port bind(0) hands out is ephemeral: between our close and the server's bind, any
# outbound connection (a client, mpirun's own) could take it, and the server then failed
# with "port already in use" (one CI run in many).
_CANDIDATES = iter(random.Random(os.getpid()).sample(range(20000, 32768), 12768))


def free_port() -> int:
    for port in _CANDIDATES:
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


Body = bytes | str | dict | list[bytes] | None  # a list of bytes is sent chunked


def call(port: int, method: str, path: str, body: Body = None,
         headers: dict[str, str] | None = None, timeout: float = 30.0) -> Reply:
    """One raw HTTP request (for what the openai client will not send: broken bodies...)."""
    if isinstance(body, dict):
        body = json.dumps(body)
    elif isinstance(body, list):
        body = iter(body)  # type: ignore[assignment]  # no length: Transfer-Encoding chunked
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        # The server may answer (e.g. 413) before it has read the whole body. A reset while
        # connecting (a server closing its listener) leaves no socket to read an answer
        # from: that is no answer, an OSError like a refused connection.
        try:
            conn.request(method, path, body=body, headers=hdrs)
        except (BrokenPipeError, ConnectionResetError):
            if conn.sock is None:
                raise
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def _proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a live process, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _proc_stat(int(entry.name))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    run_dir: Path
    out_path: Path
    err_path: Path
    launched_at: float
    history: list[Probe] = field(default_factory=list)
    # mpirun's session directory (runtime.dist.mpi.mpi_session) when the harness started mpirun.
    session: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def client(self, timeout: float = 60.0) -> openai.OpenAI:
        # No retries: a 429 or 503 must reach the test, not be retried away.
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0,
                             timeout=timeout)

    def async_client(self, timeout: float = 120.0) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0,
                                  timeout=timeout)

    def call(self, method: str, path: str, body: Body = None,
             headers: dict[str, str] | None = None, timeout: float = 30.0) -> Reply:
        return call(self.port, method, path, body, headers, timeout)

    def metrics(self) -> str:
        reply = self.call("GET", "/metrics", timeout=10)
        assert reply.status == 200, reply
        return reply.body.decode()

    # ---- run directory ---------------------------------------------------------------

    def run_file(self, rank: int, kind: str) -> int | None:
        try:
            return int((self.run_dir / f"rank{rank}.{kind}").read_text())
        except (OSError, ValueError):
            return None

    def wait_exit_codes(self, ranks: int, timeout: float) -> dict[int, int | None]:
        """Each rank's worker exit code, waiting up to `timeout` for all of them."""
        deadline = time.monotonic() + timeout
        while True:
            codes = {r: self.run_file(r, "exit") for r in range(ranks)}
            if all(c is not None for c in codes.values()) or time.monotonic() > deadline:
                return codes
            time.sleep(0.05)

    # ---- start-up --------------------------------------------------------------------

    def probe(self) -> Probe:
        t = time.monotonic() - self.launched_at
        try:
            live: int | None = self.call("GET", "/health/live", timeout=5).status
        except OSError:
            live = None
        try:
            r = self.call("GET", "/health/ready", timeout=5)
        except OSError:
            return Probe(t, live, None)
        try:
            body = r.json()
        except ValueError:
            body = r.body
        return Probe(t, live, r.status, r.headers, body)

    def wait_ready(self, timeout: float = 120.0) -> list[Probe]:
        """Poll liveness and readiness from launch until ready; every probe is recorded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self.probe()
            self.history.append(p)
            if p.ready == 200:
                return self.history
            if self.proc.poll() is not None and p.live is None:
                raise AssertionError(f"the server exited ({self.proc.returncode}) before "
                                     f"ready\n{self.logs()}")
            time.sleep(0.05)
        raise AssertionError(f"not ready within {timeout} s\n{self.logs()}")

    # ---- output and teardown -----------------------------------------------------------

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def logs(self, tail: int = 4000) -> str:
        out = self.out_path.read_text(errors="replace")[-tail:]
        return f"--- stdout ---\n{out}\n--- stderr ---\n{self.stderr()[-tail:]}"

    def worker_pids(self) -> list[int]:
        pids = [self.run_file(r, "pid") for r in range(8)]
        return [p for p in pids if p is not None and str(self.run_dir) in cmdline(p)]

    def close(self) -> None:
        """Kill mpirun, the supervisors and the workers of this launch; wait until gone."""
        ours = set(self.worker_pids())  # only pids whose command line names our run dir
        ours.update(p for p in _descendants(self.proc.pid) if str(self.run_dir) in cmdline(p))
        if self.proc.poll() is None:  # not reaped yet, so its pid and group are still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in ours:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in ours) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.session.close()


def launch(engine: Path | str, workdir: Path, n: int = 2, args: tuple[str, ...] = (),
           prefix: tuple[str, ...] | None = None, env: dict[str, str] | None = None) -> Server:
    """Start `mpirun -n n python -m serve launch --engine engine ...`; returns at once.

    With `prefix`, the command is `*prefix python -m serve launch ...` instead: our own
    launcher starts mpirun (e.g. prefix = ("unshare", "--pid", ...), a container)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    run_dir = workdir / "run"
    out_path, err_path = workdir / "stdout.log", workdir / "stderr.log"
    head = [*mpirun_argv(n)] if prefix is None else list(prefix)
    cmd = [*head, sys.executable, "-m", "serve", "launch", "--engine", str(engine),
           "--host", HOST, "--port", str(port), "--run-dir", str(run_dir), *args]
    session, child_env = contextlib.ExitStack(), {**subprocess_env(), **(env or {})}
    if prefix is None:  # else our launcher starts mpirun, in a session directory of its own
        child_env = session.enter_context(mpi_session(child_env))
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Server(proc, port, run_dir, out_path, err_path, time.monotonic(), session=session)


def run_to_exit(engine: Path | str, workdir: Path, n: int, timeout: float = 120.0,
                env: dict[str, str] | None = None) -> tuple[Server, int]:
    """Launch a server that is expected to fail start-up; returns mpirun's exit status."""
    server = launch(engine, workdir, n, env=env)
    try:
        rc = server.proc.wait(timeout)
        server.session.close()
    except subprocess.TimeoutExpired:
        server.close()
        raise AssertionError(f"the launch did not exit within {timeout} s\n"
                             f"{server.logs()}") from None
    return server, rc


def assert_a_flipped_byte_fails_the_verify_gate(engine_dir: Path, damaged: str, offset: int,
                                                 workdir: Path) -> None:
    """Copy a TP=2 engine, flip one bit of its file `damaged` (the first .so under it when it
    is a directory) at `offset` (from the end when negative), launch it: start-up must fail
    at the verify gate, on every rank, naming that file, with no traceback."""
    engine = workdir / "engine"
    shutil.copytree(engine_dir, engine)
    path = engine / damaged
    if path.is_dir():
        path = next(path.rglob("*.so"))
    path.chmod(path.stat().st_mode | stat.S_IWUSR)  # the store makes engines read-only
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    srv, rc = run_to_exit(engine, workdir / "serve", n=2)
    try:
        err = srv.stderr()
        assert rc != 0, srv.logs()
        assert srv.wait_exit_codes(2, 10) == {0: 1, 1: 1}, srv.logs()
        lines = [ln for ln in err.splitlines() if "gate verify failed" in ln]
        name = str(path.relative_to(engine))
        assert lines and all(name in ln for ln in lines), srv.logs()
        assert "Traceback" not in err
    finally:
        srv.close()
