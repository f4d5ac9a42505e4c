"""The server as a container's main process: `serve launch` is PID 1 of a PID namespace
(what Docker and Kubernetes make), and the runtime stops it with SIGTERM (or SIGINT).

When PID 1 exits, the kernel kills everything left in the namespace, so nothing of the
job may outlive a drain that has not finished; and PID 1's exit status is what the
orchestrator records. Open MPI's own launcher as PID 1 cannot drain (it kills its ranks
0.5 s after a SIGTERM it cannot forward), which is why `serve launch` on its own starts
mpirun itself and turns the stop signal into a drain (serve/launcher.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest

from serve.launch import EXIT_DRAIN_CUT
from tests.e2e.conftest import MAX_SEQ_LEN, MODEL, Reference
from tests.e2e.harness import Server, launch
from tests.e2e.test_serve_lifecycle import Completion, Streamer, _wait_until

NAMESPACE = ("unshare", "--pid", "--fork", "--mount-proc")


def _namespaces_work() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    proc = subprocess.run([*NAMESPACE, "true"], capture_output=True, text=True)
    return None if proc.returncode == 0 else f"no PID namespaces here: {proc.stderr.strip()}"


pytestmark = pytest.mark.skipif(_namespaces_work() is not None, reason=str(_namespaces_work()))


def _pid1(srv: Server) -> int:
    """The namespace's PID 1 (unshare --fork's child), as seen from outside."""
    children = Path(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children")
    _wait_until(lambda: children.read_text().split(), 10, "PID 1 of the namespace")
    return int(children.read_text().split()[0])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_to_pid_1_drains_every_request_then_pid_1_exits_0(
        engine_dir: Path, reference: Reference, tmp_path: Path, signum: int) -> None:
    prompts, n = ["The quick brown fox", "emoji 🙂 and ✓"], 150
    wants = [reference.completion(p, n, ignore_eos=True) for p in prompts]
    srv = launch(engine_dir, tmp_path, args=("--drain-timeout", "60"), prefix=NAMESPACE)
    try:
        srv.wait_ready()
        streams = [Streamer(srv, p, n) for p in prompts]
        plain = Completion(srv, "Héllo wörld", n)
        want_plain = reference.completion("Héllo wörld", n, ignore_eos=True)
        for t in (*streams, plain):
            t.start()
        for s in streams:
            assert s.first.wait(60) and s.error is None, s.error
        pid1 = _pid1(srv)
        signalled = time.monotonic()
        os.kill(pid1, signum)
        _wait_until(lambda: srv.call("GET", "/health/ready").status == 503, 5, "ready 503")
        with pytest.raises(openai.InternalServerError) as refused:
            srv.client().completions.create(model=MODEL, prompt="new", max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.code == "server_draining"
        assert any(s.is_alive() for s in streams), "the drain was not observed mid-generation"
        for t in (*streams, plain):
            t.join(60)
        for s, want in zip(streams, wants):
            assert s.error is None, s.error
            assert (s.text, s.finish, s.completion_tokens) == (want.text, "length", n)
        assert plain.error is None and plain.text == want_plain.text, plain.error
        assert srv.proc.wait(60) == 0, srv.logs()  # PID 1's status is unshare's
        assert time.monotonic() - signalled < 60
        assert srv.wait_exit_codes(2, 1) == {0: 0, 1: 0}, srv.logs()
    finally:
        srv.close()


def test_a_drain_deadline_that_cuts_requests_exits_non_zero(
        engine_dir: Path, tmp_path: Path) -> None:
    srv = launch(engine_dir, tmp_path, args=("--drain-timeout", "0.5"), prefix=NAMESPACE)
    try:
        srv.wait_ready()
        long = Streamer(srv, "The quick brown fox", MAX_SEQ_LEN - 16)
        long.start()
        assert long.first.wait(60) and long.error is None, long.error
        os.kill(_pid1(srv), signal.SIGTERM)
        rc = srv.proc.wait(30)
        assert rc == EXIT_DRAIN_CUT, srv.logs()
        long.join(10)
        assert not long.is_alive()
        assert long.completion_tokens is None  # cut: no final usage chunk
        assert "1 request(s) cut at the deadline" in (tmp_path / "run" / "rank0.log").read_text()
    finally:
        srv.close()
