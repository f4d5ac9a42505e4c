"""A worker's lifecycle: stop signals, its supervisor's death and peer failures.

Rank 0 (serve/rank0.py) and the other ranks (serve/worker.py) share it; it records the
worker's exit code in the run directory when it leaves at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from runtime.env import PARENT_FD
from runtime.store.files import close_all

log = logging.getLogger("serve")
RUN_LOG = "serve.run_log"  # writes to rank{N}.log only (errors already printed on stderr)


class Lifecycle:
    """Signals, supervisor death and peer failures, seen from the worker."""

    def __init__(self, run_dir: Path | None = None, rank: int = 0) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.drain = threading.Event()  # SIGTERM/SIGINT/SIGHUP arrived (or rank 0 was asked)
        self.serving = threading.Event()  # admission opened: from now on a drain has work
        # What a failed peer connection does; rank 0 replaces it once it serves.
        self.on_peer_failure: Callable[[str], None] = self._peer_failed_starting
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.drain.set())
        fd = PARENT_FD.raw()
        if fd is not None:
            threading.Thread(target=self._watch_parent, args=(int(fd),), daemon=True).start()

    def _watch_parent(self, fd: int) -> None:
        while os.read(fd, 1):
            pass
        # The launcher kills the supervisor right after forwarding a signal (a drain);
        # a supervisor that dies with no signal first means the job is failing.
        time.sleep(0.2)
        if not self.drain.is_set():
            self.error(f"rank {self.rank}: the rank's supervisor died without a shutdown "
                       "signal; exiting")
            self.exit_now(1)
        if not self.serving.is_set():
            # Before admission there is nothing to drain: mpirun is ending the job (a rank
            # died, or mpirun itself was signalled). Finishing the gate at hand first (a
            # load reads the whole shard) would keep this rank alive for nothing.
            self.error(f"rank {self.rank}: its supervisor is gone during start-up (mpirun "
                       "is ending the job); exiting")
            self.exit_now(1)

    def peer_failed(self, why: str) -> None:
        """From the peer watch (runtime/dist/comm.py): a peer died or its host stopped answering."""
        self.on_peer_failure(why)

    def _peer_failed_starting(self, why: str) -> None:
        self.error(f"rank {self.rank}: {why}; the job cannot go on without it, exiting")
        self.exit_now(1)

    def drain_requested(self, peer: int) -> None:
        if not self.drain.is_set():
            log.info("rank %d asked for a drain (its host is stopping)", peer)
            self.drain.set()

    def error(self, message: str) -> None:
        """An error line on stderr, kept in rank{N}.log too: when mpirun ends the job first,
        the worker's stderr (a pipe to mpirun) is gone and only the log file remains."""
        with contextlib.suppress(OSError):  # a pipe to an mpirun that is gone
            print(f"error: {message}", file=sys.stderr, flush=True)
        logging.getLogger(RUN_LOG).error("%s", message)

    def exit_now(self, code: int) -> None:
        """Leave at once, from any thread (the job is failing); rank{N}.exit records it."""
        close_all()
        write_run_file(self.run_dir, self.rank, "exit", code)
        with contextlib.suppress(OSError):
            sys.stderr.flush()
        os._exit(code)


def write_run_file(run_dir: Path | None, rank: int, kind: str, value: int) -> None:
    if run_dir is None:
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".rank{rank}.{kind}"
        tmp.write_text(f"{value}\n")
        tmp.rename(run_dir / f"rank{rank}.{kind}")
    except OSError:
        pass
