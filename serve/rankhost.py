"""`serve rank-host -- CMD...`: the main process of a host that runs ranks > 0 only.

On a multi-host deployment (a LeaderWorkerSet's worker pods) the ranks of a worker host
are started by mpirun on the leader, through a daemon the worker host runs (sshd, through
which PRRTE starts its `prted`, which starts our ranks). The orchestrator stops a pod by
signalling its PID 1 and kills what is left when PID 1 exits; if that were sshd, a stop
would kill this host's ranks at once and fail every request in flight on the leader.

So PID 1 is this process. It runs CMD (the daemon) as its child and, on SIGTERM/SIGINT:
forwards the signal to the rank processes among its descendants (our supervisors, which
forward it to their workers; a worker that serves then asks rank 0 to drain the whole job),
waits until every rank process has exited (rank 0 ends the job after its drain) or
--drain-timeout plus GRACE_S has passed, and only then stops CMD and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("serve.rank-host")
GRACE_S = 15.0
KILL_WAIT_S = 5.0


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def rank_processes(root: int) -> tuple[list[int], list[int]]:
    """(supervisors, workers) among the live descendants of `root`."""
    children = _children_map()
    sups, workers, todo = [], [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            argv = _argv(child)
            if b"serve.worker" in argv:
                workers.append(child)
            elif b"serve" in argv and b"launch" in argv:
                sups.append(child)
    return sups, workers


class RankHost:
    def __init__(self, cmd: list[str], drain_timeout: float) -> None:
        self.cmd, self.drain_timeout = cmd, drain_timeout
        self.stop_at: float | None = None

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop_at is None:
            self.stop_at = time.monotonic()
            log.info("%s: waiting for this host's ranks (rank 0 drains the job)",
                     signal.Signals(signum).name)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        proc = subprocess.Popen(self.cmd)
        signalled: set[int] = set()
        while True:
            try:
                return proc.wait(0.2)
            except subprocess.TimeoutExpired:
                pass
            if self.stop_at is None:
                continue
            sups, workers = rank_processes(proc.pid)
            for pid in sups:
                if pid not in signalled:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                    signalled.add(pid)
            overdue = time.monotonic() - self.stop_at > self.drain_timeout + GRACE_S
            if not (sups or workers) or overdue:
                if overdue:
                    log.error("this host's ranks did not exit within --drain-timeout plus "
                              "%.0f s; stopping", GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    proc.wait(KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return 0 if not overdue else 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="serve rank-host",
        description="PID 1 of a host that runs ranks > 0 (a worker pod): runs CMD (the daemon "
        "mpirun starts ranks through, e.g. sshd) and on a stop signal keeps the host up until "
        "its ranks have exited.")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="the job's --drain-timeout (default 30); CMD is stopped at the latest "
                   f"this plus {GRACE_S:.0f} s after the stop signal")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    ns = p.parse_args(argv)
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    if not cmd:
        p.error("give the daemon to run after --, e.g. -- /usr/sbin/sshd -D -e")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s [rank-host] %(levelname)s %(message)s")
    try:
        return RankHost(cmd, ns.drain_timeout).run()
    except OSError as e:
        print(f"error: cannot run {cmd[0]}: {e.strerror or e}", file=sys.stderr)
        return 2
