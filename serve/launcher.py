"""`serve launch` run outside mpirun: a launcher of ours that owns mpirun.

Why it exists: a container runtime (Docker, Kubernetes) signals the container's PID 1,
and when PID 1 exits the kernel kills every other process of the PID namespace. Open MPI
5's launcher answers SIGTERM, SIGINT and SIGHUP by killing its ranks (SIGCONT, SIGTERM,
SIGKILL, 0.25 s apart) and exiting 1; it can forward neither of them (PRRTE 3.0:
`ess_base_frame.c` marks them not forwardable, `odls_base_default_fns.c` kills). With
mpirun as PID 1, a stop signal therefore cuts every in-flight request.

So in a container PID 1 is this launcher. mpirun runs as its child, in a session of its
own (a terminal's Ctrl-C reaches only us), and a stop signal becomes a drain: SIGTERM to
the local rank processes (our supervisors, mpirun's children), which forward it to their
workers; rank 0 drains and ends the job, every rank exits, mpirun exits with their status,
and so do we. mpirun itself never sees a signal unless the drain overruns its deadline
or a second signal asks to stop at once.

Several hosts (`--hosts` or `--hostfile`, and mpirun's own arguments with `--mpirun-arg`):
rank 0 runs on this host (the first one listed) and ends the job on every host when it has
drained; a rank on another host whose host is stopping asks rank 0 for the same drain. The
environment the ranks need is forwarded to the other hosts (`-x`). mpirun dies with this
launcher (PR_SET_PDEATHSIG), and once every rank of this host has exited, an mpirun that
cannot end the job on a host that dropped off the network is stopped after LINGER_S.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from contract.errors import BuildError
from runtime.dist.mpi import MPIRUN_ENV, MpirunError, child_env, mpi_session, mpirun_argv
from runtime.env import API_KEY
from runtime.store.source import engine_tp
from serve.launch import LaunchConfig

log = logging.getLogger("serve.launcher")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 15.0  # beyond --drain-timeout: cutting requests, closing HTTP, finalizing MPI
KILL_WAIT_S = 5.0
LINGER_S = 5.0  # mpirun alive this long after this host's ranks all exited: stop it
# Forwarded to the ranks of other hosts (mpirun -x); not the API key, which only rank 0
# (on this host) reads.
FORWARD_PREFIXES = ("AOTLLM_", "GLOO_", "NCCL_", "TORCH_", "OMP_", "HF_")
FORWARD_NAMES = ("PYTHONPATH",)
NOT_FORWARDED = (API_KEY.name,)
_PR_SET_PDEATHSIG = 1


def forwarded_env(env: dict[str, str]) -> list[str]:
    """`-x NAME` for each variable the ranks of other hosts need."""
    names = sorted(k for k in env if (k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES)
                   and k not in NOT_FORWARDED)
    return [a for k in names for a in ("-x", k)]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (mpirun then takes its
    daemons on the other hosts down, and the ranks' supervisors see it; serve/supervisor.py)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def under_mpirun() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))


def rank_processes(mpirun_pid: int) -> list[int]:
    """mpirun's children on this host that are our rank processes (serve launch)."""
    pids: list[int] = []
    for task in Path(f"/proc/{mpirun_pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids.extend(int(p) for p in (task / "children").read_text().split())
    ours = []
    for pid in pids:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in argv and b"launch" in argv:
                ours.append(pid)
    return ours


class Launcher:
    def __init__(self, argv: list[str], cfg: LaunchConfig, tp: int) -> None:
        self.argv, self.cfg, self.tp = argv, cfg, tp
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_requested: float | None = None  # monotonic time of the first stop signal
        self.abort = False  # a second stop signal: end now
        self.signalled: set[int] = set()
        self.seen_ranks = False  # a rank process of this host has been seen
        self.ranks_gone: float | None = None  # when this host's rank processes all exited

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop_requested is None:
            self.stop_requested = time.monotonic()
            log.info("%s: draining (up to %.0f s)", signal.Signals(signum).name,
                     self.cfg.drain_timeout)
        else:
            self.abort = True

    def _drain(self) -> None:
        """SIGTERM every rank process not signalled yet (ranks may still be starting)."""
        assert self.proc is not None
        for pid in rank_processes(self.proc.pid):
            if pid not in self.signalled:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                self.signalled.add(pid)

    def _kill(self) -> None:
        """mpirun's own abort (it kills the ranks), then SIGKILL to what is left."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def _watch_linger(self) -> bool:
        """True once mpirun has outlived every rank of this host by LINGER_S."""
        assert self.proc is not None
        if rank_processes(self.proc.pid):
            self.seen_ranks, self.ranks_gone = True, None
            return False
        if not self.seen_ranks:
            return False
        if self.ranks_gone is None:
            self.ranks_gone = time.monotonic()
        return time.monotonic() - self.ranks_gone > LINGER_S

    def command(self) -> list[str]:
        cfg = self.cfg
        several = cfg.hosts is not None or cfg.hostfile is not None
        extra = (*(forwarded_env(child_env()) if several else ()), *cfg.mpirun_args)
        mpirun = mpirun_argv(self.tp, cfg.mpirun, cfg.hosts,
                             str(cfg.hostfile) if cfg.hostfile else None, extra)
        return [*mpirun, sys.executable, "-m", "serve", "launch", *self.argv]

    def run(self) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        cmd = self.command()
        with mpi_session(child_env()) as env:
            env[MPIRUN_ENV] = cmd[0]  # the ranks name it if their MPI library disagrees
            log.info("starting %s", " ".join(cmd))
            self.proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent)
            return self._supervise(self.proc)

    def _supervise(self, proc: subprocess.Popen[bytes]) -> int:
        """Wait for mpirun: stop it when its ranks are gone, drain on a stop signal."""
        while True:
            try:
                rc = proc.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if self._watch_linger():
                print(f"error: every rank on this host has exited but mpirun has not ended the "
                      f"job after {LINGER_S:.0f} s (a host it cannot reach?); stopping it",
                      file=sys.stderr, flush=True)
                self._kill()
                proc.wait()
                return 1
            if self.stop_requested is None:
                continue
            overdue = time.monotonic() - self.stop_requested > self.cfg.drain_timeout + GRACE_S
            if self.abort or overdue:
                print("error: the job did not end within --drain-timeout "
                      f"({self.cfg.drain_timeout:.0f} s) plus {GRACE_S:.0f} s; stopping it"
                      if overdue else "error: second stop signal; stopping the job now",
                      file=sys.stderr, flush=True)
                self._kill()
                rc = proc.wait()
                break
            self._drain()
        return rc if rc >= 0 else 128 - rc


def launch(argv: list[str], cfg: LaunchConfig) -> int:
    """Start `mpirun -n TP serve launch ...` (TP from the engine's manifest) and own it."""
    try:  # an engine in a store: its manifest (the cache's when it is the one pinned)
        tp = engine_tp(cfg.engine, cfg.engine_cache, cfg.store_deadline)
    except BuildError as e:
        print(e, file=sys.stderr)
        return e.exit_code
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s [launcher] %(levelname)s %(message)s")
    try:
        return Launcher(argv, cfg, tp).run()
    except MpirunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
