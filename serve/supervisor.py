"""The process mpirun starts: bootstrap over MPI, then run the real worker detached.

Open MPI 5's launcher answers SIGTERM/SIGINT by sending its ranks SIGCONT, SIGTERM 0.25 s
later and SIGKILL 0.25 s after that (PRRTE `surekill`, not configurable). A server must
drain for up to --drain-timeout, so the serving process is this supervisor's child in its
own session, out of the launcher's reach: the supervisor forwards the signal and mirrors
the worker's exit code while it lives. A worker whose supervisor dies without having
forwarded a signal first (a crash, kill -9) exits non-zero at once; see serve/worker.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from runtime.comm import Bootstrap, mpi_bootstrap

PARENT_FD_ENV = "AOTLLM_PARENT_FD"
PLAN_FD_ENV = "AOTLLM_PLAN_FD"


LAUNCH_TIME_ENV = "AOTLLM_LAUNCH_TIME"


def supervise(worker_argv: list[str], host: str = "127.0.0.1") -> int:
    launched = time.time()  # the interpreter's own start (~0.3 s) precedes this
    boot, listener = mpi_bootstrap(host)
    # The worker watches the read end: EOF means this supervisor is gone.
    parent_r, parent_w = os.pipe()
    env = dict(os.environ)
    env[Bootstrap.ENV] = boot.to_env()
    env.setdefault(LAUNCH_TIME_ENV, repr(launched))
    env[PARENT_FD_ENV] = str(parent_r)
    fds = [parent_r]
    if listener is not None:
        env[PLAN_FD_ENV] = str(listener.fileno())
        fds.append(listener.fileno())
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve.worker", *worker_argv], env=env, pass_fds=fds,
        start_new_session=True,
    )
    os.close(parent_r)
    if listener is not None:
        listener.close()

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            rc = proc.wait()
            break
        except InterruptedError:
            continue
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
