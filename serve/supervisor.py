"""The process mpirun starts: bootstrap over MPI, then run the real worker detached.

Open MPI 5's launcher answers SIGTERM/SIGINT by sending its ranks SIGCONT, SIGTERM 0.25 s
later and SIGKILL 0.25 s after that (PRRTE `surekill`, not configurable). A server must
drain for up to --drain-timeout, so the serving process is this supervisor's child in its
own session, out of the launcher's reach: the supervisor forwards the signal and mirrors
the worker's exit code while it lives. A worker whose supervisor dies without having
forwarded a signal first (a crash, kill -9) exits non-zero at once; see serve/worker.py.

The supervisor in turn watches its own parent (mpirun on rank 0's host, PRRTE's daemon on
the others): when that dies without a signal (kill -9, its host's launcher gone), the
supervisor leaves too, and with it the worker, within ORPHAN_POLL_S.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from runtime.dist.bootstrap import mpi_bootstrap
from runtime.dist.netif import InterfaceError
from runtime.env import BOOT_SOCK, LAUNCH_TIME, PARENT_FD
from serve.cores import widen_for_worker

PARENT_FD_ENV = PARENT_FD.name
BOOT_SOCK_ENV = BOOT_SOCK.name
LAUNCH_TIME_ENV = LAUNCH_TIME.name
ORPHAN_POLL_S = 0.5


def supervise(worker_argv: list[str], comm_iface: str | None = None) -> int:
    launched = time.time()  # the interpreter's own start (~0.3 s) precedes this
    parent = os.getppid()
    # The worker starts first and imports torch (~2.5 s on 2 cores) while this process
    # does the MPI bootstrap (~1 s: mpi4py, MPI_Init, the rendezvous); it then receives
    # the bootstrap, and rank 0's listening sockets, over a socket pair (BOOT_SOCK_ENV).
    # The worker watches the pipe's read end: EOF means this supervisor is gone.
    parent_r, parent_w = os.pipe()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    env.setdefault(LAUNCH_TIME_ENV, repr(launched))
    env[PARENT_FD_ENV] = str(parent_r)
    env[BOOT_SOCK_ENV] = str(theirs.fileno())
    widen_for_worker(env)  # before the worker's OpenMP reads its affinity mask
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve.worker", *worker_argv], env=env,
        pass_fds=[parent_r, theirs.fileno()], start_new_session=True,
    )
    os.close(parent_r)
    theirs.close()
    try:
        boot, listeners = mpi_bootstrap(comm_iface)
    except InterfaceError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        proc.kill()  # it has received nothing: nothing to drain
        proc.wait()
        os._exit(2)  # without MPI_Finalize: mpirun ends the job
    with ours:
        socket.send_fds(ours, [boot.to_json().encode()],
                        listeners.fds() if listeners is not None else [])
    if listeners is not None:
        listeners.close()
    signalled = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal signalled
        signalled = True
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            rc = proc.wait(ORPHAN_POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        except InterruptedError:
            continue
        if os.getppid() != parent and not signalled:
            # mpirun (or PRRTE's daemon) is gone without a word: so is the job. Closing the
            # pipe tells the worker; it exits at once (no signal came first).
            print(f"error: rank {boot.rank}: mpirun's process on this host died; ending this "
                  "rank", file=sys.stderr, flush=True)
            os.close(parent_w)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            os._exit(1)
    os.close(parent_w)
    if rc < 0:
        # A worker killed by a signal (kill -9, the OOM killer) prints nothing itself: this
        # line, forwarded by mpirun to the launcher's stderr, is the job's only cause.
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        print(f"error: rank {boot.rank}: its serving process (pid {proc.pid}) was killed by "
              f"{name}; the job ends", file=sys.stderr, flush=True)
    if rc == 0:
        from mpi4py import MPI

        MPI.Finalize()
        return 0
    # Exiting without MPI_Finalize makes the launcher take the whole job down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc if rc > 0 else 128 - rc)


def receive_bootstrap(fd: int) -> tuple[str, list[socket.socket]]:
    """The worker's side: the bootstrap (Bootstrap.to_json's text) and rank 0's listening
    sockets, sent once by the supervisor, which then closes its end. Blocks until then;
    ConnectionError if the supervisor ended without sending (its bootstrap failed)."""
    with socket.socket(fileno=fd) as sock:
        first, fds, _, _ = socket.recv_fds(sock, 1 << 16, 64)
        chunks = [first]
        while first and (more := sock.recv(1 << 16)):
            chunks.append(more)
    if not first:
        raise ConnectionError("the rank's supervisor ended before the MPI bootstrap finished")
    return b"".join(chunks).decode(), [socket.socket(fileno=f) for f in fds]
