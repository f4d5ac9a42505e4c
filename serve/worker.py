"""One rank's serving process: gates, then serving until drained or failed.

Started by serve/supervisor.py (under mpirun) in its own session. Rank 0 binds HTTP first
(/health/live answers during start-up), passes the gates with the other ranks, opens
admission and runs the engine loop on the main thread; other ranks execute plans.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.dist.bootstrap import Bootstrap, Listeners
from runtime.dist.comm import Comm
from runtime.env import BOOT_SOCK, PARENT_FD
from runtime.store.files import close_all
from serve.cores import pin_compute_thread
from serve.gates import GateFailure, GateLog
from serve.gcpolicy import PAUSES, freeze_heap, hold_collector
from serve.launch import LaunchConfig, parse
from serve.supervisor import receive_bootstrap
from serve.threads import thread_plan

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
        _write_run_file(self.run_dir, self.rank, "exit", code)
        with contextlib.suppress(OSError):
            sys.stderr.flush()
        os._exit(code)


def _setup_logging(level: str, rank: int, run_dir: Path | None) -> None:
    logging.raiseExceptions = False  # stderr may be a pipe to a launcher that is gone
    fmt = f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=fmt)
    run_log = logging.getLogger(RUN_LOG)
    run_log.propagate = False
    run_log.addHandler(logging.NullHandler())
    if run_dir is not None:
        # mpirun, and with it the workers' stderr, is gone 0.5 s into a drain: the drain's
        # own messages are only visible here.
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(run_dir / f"rank{rank}.log")
        except OSError:
            return
        handler.setFormatter(logging.Formatter(fmt))
        logging.getLogger().addHandler(handler)
        run_log.addHandler(handler)


def _check_port(host: str, port: int) -> str | None:
    """Whether host:port can be bound, checked at once (the HTTP layer itself comes up on
    a thread while the gates run); the reason when it cannot."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"cannot start the HTTP server: host {host!r} does not resolve ({e.strerror})"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            s.listen(1)  # a live listener elsewhere makes this fail, as the real bind would
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"cannot start the HTTP server: port {port} on {host} is already in "
                        "use (is another server running? pick another port)")
            return f"cannot bind the HTTP server to {host}:{port}: {e.strerror or e}"
    return None


class HttpStartupFailed(RuntimeError):
    """The HTTP layer did not come up (the port was taken meanwhile, an import failed)."""


class HttpStartup:
    """Rank 0's HTTP layer, imported and started on a thread of its own while the gates
    run (its imports cost about a second of CPU): liveness answers once it is up,
    readiness after admission. `wait()` returns (state, server) or raises."""

    def __init__(self, cfg: LaunchConfig, on_state: Callable[[Any], None]) -> None:
        self.cfg, self.on_state = cfg, on_state
        self.state: Any = None
        self.http: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="http-startup", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cfg = self.cfg
        try:
            from runtime.core.grammar import GrammarConfig
            from serve.api import ServerState, start_http_server

            grammar = GrammarConfig(compile_timeout_s=cfg.grammar_compile_timeout,
                                    compile_workers=cfg.grammar_compile_workers,
                                    cache_bytes=cfg.grammar_cache_mib << 20)
            state = ServerState(model_name="(starting)", tokenizer=None, max_seq_len=2,
                                max_queue=cfg.max_queue, max_body_bytes=cfg.max_body_bytes,
                                api_key=cfg.api_key, max_connections=cfg.max_connections,
                                header_timeout=cfg.header_timeout, grammar=grammar,
                                reasoning_parser=cfg.reasoning_parser,
                                tool_parser=cfg.tool_parser)
            self.on_state(state)
            self.http = start_http_server(state, cfg.host, cfg.port)
            self.state = state
            log.info("HTTP listening on http://%s:%d (liveness now, readiness after the gates)",
                     cfg.host, self.http.port)
        except BaseException as e:
            self.error = e

    def wait(self) -> tuple[Any, Any]:
        self.thread.join()
        if self.error is not None:
            raise HttpStartupFailed(str(self.error)) from self.error
        return self.state, self.http


def serve_rank0(cfg: LaunchConfig, comm: Comm, life: Lifecycle, threads: dict[str, object]
                ) -> int:
    from serve.rank0 import Rank0

    why = _check_port(cfg.host, cfg.port)
    if why is not None:
        print(f"error: {why} — choose another --port or stop the other server", file=sys.stderr)
        return 2
    return Rank0(cfg, comm, life, threads).run()


def serve_follower(cfg: LaunchConfig, comm: Comm, life: Lifecycle) -> int:
    """Ranks > 0: the same gates as rank 0, then what the backend does while rank 0 serves."""
    from serve.startup import Startup

    pin_compute_thread(comm.local_rank, comm.local_size)  # as rank 0 does (serve/cores.py)
    st = Startup(cfg, comm, GateLog(), interrupted=life.drain.is_set)
    try:
        backend = st.run()
        freeze_heap()  # as rank 0 does in its admission gate
        comm.allgather("admitted")
        life.serving.set()
    except GateFailure as e:
        life.error(f"rank {comm.rank}: {e}")
        return 1

    def forward_drain() -> None:  # a stop signal here: rank 0 drains the whole job
        life.drain.wait()
        comm.peer_watch.request_drain()

    threading.Thread(target=forward_drain, name="drain-forward", daemon=True).start()
    rc = backend.follow(life.exit_now)
    if rc == 0:
        backend.finalize()
    return rc


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    boot, listeners = None, None
    boot_fd = BOOT_SOCK.raw()  # under the supervisor (mpirun); else one rank
    if boot_fd is not None:
        try:
            boot_json, plans = receive_bootstrap(int(boot_fd))
        except (ConnectionError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        boot = Bootstrap.from_json(boot_json)
        listeners = Listeners(plans) if plans else None
    rank = boot.rank if boot else 0
    _setup_logging(cfg.log_level, rank, cfg.run_dir)
    life = Lifecycle(cfg.run_dir, rank)
    PAUSES.install()
    hold_collector()
    _write_run_file(cfg.run_dir, rank, "pid", os.getpid())
    rc = 1
    try:
        comm = Comm(boot, listeners)
        comm.peer_watch.watch(life.peer_failed, life.drain_requested)
        threads = thread_plan(comm)
        rc = (serve_rank0(cfg, comm, life, threads) if rank == 0
              else serve_follower(cfg, comm, life))
    except (ConnectionError, OSError) as e:
        life.error(f"rank {rank}: lost the other ranks ({e})")
    finally:
        close_all()
        _write_run_file(cfg.run_dir, rank, "exit", rc)
    return rc


def _write_run_file(run_dir: Path | None, rank: int, kind: str, value: int) -> None:
    if run_dir is None:
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".rank{rank}.{kind}"
        tmp.write_text(f"{value}\n")
        tmp.rename(run_dir / f"rank{rank}.{kind}")
    except OSError:
        pass


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
