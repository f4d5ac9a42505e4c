"""One rank's serving process: gates, then serving until drained or failed.

Started by serve/supervisor.py (under mpirun) in its own session. Rank 0 binds HTTP first
(/health/live answers during start-up), passes the gates with the other ranks, opens
admission and runs the engine loop on the main thread; other ranks execute plans.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import threading
from pathlib import Path

from runtime.dist.bootstrap import Bootstrap, Listeners
from runtime.dist.comm import Comm
from runtime.env import BOOT_SOCK
from runtime.store.files import close_all
from serve.cores import pin_compute_thread
from serve.gates import GateFailure, GateLog
from serve.gcpolicy import PAUSES, freeze_heap, hold_collector
from serve.launch import LaunchConfig, parse
from serve.lifecycle import RUN_LOG, Lifecycle, write_run_file
from serve.stages import GateContext
from serve.supervisor import receive_bootstrap
from serve.threads import thread_plan

log = logging.getLogger("serve")


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
    st = Startup(GateContext(cfg, comm, GateLog(), interrupted=life.drain.is_set))
    try:
        serving = st.serve()
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
    rc = serving.follow(life.exit_now)
    if rc == 0:
        serving.finalize()
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
    write_run_file(cfg.run_dir, rank, "pid", os.getpid())
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
        write_run_file(cfg.run_dir, rank, "exit", rc)
    return rc


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
