"""How long the calling thread was runnable but off a core: the kernel's run-queue wait.

`/proc/thread-self/schedstat` holds three numbers for the calling thread (the kernel's
Documentation/scheduler/sched-stats.rst): nanoseconds on a CPU, nanoseconds waiting on a
run queue, and timeslices run. The second grows while the thread could run but does not:
another task holds its core (a neighbour process, a load generator, our own HTTP thread),
or its cgroup's CPU quota is spent for the period (a throttled thread stays queued). It is
the cost a step's thread team pays for contention, seen directly: each millisecond one team
member waits, the team's next barrier waits with it.

The engine loop reads it around each step on the thread that runs the step (the team's
master; its workers share its cores and its odds of being put off them), so the thread
policy (runtime/core/thread_policy.py) sees contention in the step it happens, instead of
inferring it from steps that turn slow. The file stays open and is re-read in place (the
kernel writes it anew on each read): about 1 µs a read, against 9 µs to open it each time.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

SCHEDSTAT = Path("/proc/thread-self/schedstat")


class RunQueueClock:
    """Seconds the calling thread has waited on a run queue since it started. A kernel
    without the clock (no CONFIG_SCHED_INFO, no /proc/thread-self) reads 0 throughout, so
    nothing reads as contention; `available` says which."""

    def __init__(self, path: Path = SCHEDSTAT) -> None:
        self.path = path
        self._fd: int | None = None
        self._thread = 0  # the thread whose file _fd is: /proc/thread-self resolves at open
        self.available = self._read() is not None

    def _read(self) -> float | None:
        try:
            if self._fd is None or self._thread != threading.get_ident():
                self.close()
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                self._thread = threading.get_ident()
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None

    def seconds(self) -> float:
        if not self.available:
            return 0.0
        return self._read() or 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()
