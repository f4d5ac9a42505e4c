"""A killed mpirun's session directory does not stop the next job (runtime.dist.mpi.mpi_session).

Open MPI names mpirun's session directory after its PID; the directory of an mpirun killed
with SIGKILL stays, and an mpirun given the same PID later exits 213 before any rank runs
("The PMIx server's listener thread failed to start"). In a container's PID namespace that
PID is the same every time, so the second container on a host with a shared /tmp failed
(seen once in CI, through PID wrap-around on the host). Here: real mpiruns, each in a PID
namespace of its own (as a container runs them), a temporary directory of the test's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.dist.mpi import MPIRUN_ENV, find_mpirun
from tests.conftest import REPO, subprocess_env

# PID 1 of the namespace is this Python; the mpirun it starts is PID 2, every time.
_JOB = """
import subprocess, sys
from runtime.dist.mpi import child_env, mpi_session, mpirun_argv
cmd = [*mpirun_argv(1), *sys.argv[2:]]
if sys.argv[1] == "session":
    with mpi_session(child_env()) as env:
        sys.exit(subprocess.run(cmd, env=env).returncode)
sys.exit(subprocess.run(cmd, env=child_env()).returncode)
"""


@pytest.fixture
def tmpdir_env() -> Iterator[dict[str, str]]:
    """TMPDIR of the jobs: a directory of this test's own."""
    with tempfile.TemporaryDirectory(prefix="mpis") as tmp:
        # The mpirun named outright: finding it would start a probe process, taking PID 2.
        yield {**subprocess_env(), "TMPDIR": tmp, MPIRUN_ENV: find_mpirun()}


def _container(env: dict[str, str], mode: str, *cmd: str) -> list[str]:
    return ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _JOB, mode, *cmd]


def _kill_a_container_mid_job(env: dict[str, str], mode: str) -> list[Path]:
    """Start a job in a PID namespace, SIGKILL it once mpirun's rendezvous file exists; the
    session directories it leaves behind."""
    tmp = Path(env["TMPDIR"])
    proc = subprocess.Popen(_container(env, mode, "sleep", "60"), cwd=REPO, env=env,
                            start_new_session=True, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    try:
        while not any(tmp.rglob("pmix.*")):
            assert proc.poll() is None and time.monotonic() < deadline, "mpirun did not start"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the namespace's PID 1 dies: all of it dies
        proc.wait(10)
    return sorted(tmp.rglob("ompi.*"))


def _run(env: dict[str, str], mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_container(env, mode, "true"), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_killed_jobs_session_directory_does_not_stop_the_next(
        tmpdir_env: dict[str, str]) -> None:
    tmp = Path(tmpdir_env["TMPDIR"])
    stale = _kill_a_container_mid_job(tmpdir_env, "bare")
    assert [p.relative_to(tmp).as_posix() for p in stale] == ["ompi.2"]

    done = _run(tmpdir_env, "session")  # as every launcher of the project starts mpirun
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(tmp.iterdir()) == stale  # its own directory removed, the stale one kept

    # The hazard is real: without a directory of its own, the same job cannot start.
    done = _run(tmpdir_env, "bare")
    assert done.returncode != 0 and "listener thread failed to start" in done.stdout + done.stderr


def test_a_killed_job_in_a_session_leaves_nothing_in_the_way(
        tmpdir_env: dict[str, str]) -> None:
    tmp = Path(tmpdir_env["TMPDIR"])
    left = _kill_a_container_mid_job(tmpdir_env, "session")
    assert [p.parent.parent == tmp and p.name == "ompi.2" for p in left] == [True]
    for mode in ("session", "bare"):  # the default directory was never used
        done = _run(tmpdir_env, mode)
        assert done.returncode == 0, done.stdout + done.stderr
