"""The control plane and the data plane of one TP job.

MPI only bootstraps: it says who is rank 0 and carries rank 0's addresses and a fresh
secret to the others. After that, plain TCP carries the control plane (each step's plan
from rank 0, start-up all-gathers, as JSON frames: runtime/wire.py) and a torch process
group (gloo on CPU, NCCL on CUDA) carries the collectives compiled into the model.

The plan port is open on the host during start-up, so a peer must prove it knows the
secret (HMAC challenge-response, both ways) before anything it sends is read; a stranger
is refused and start-up goes on waiting for the real ranks. Why not MPI for the steps: Open MPI 5's launcher
SIGKILLs its ranks 0.5 s after forwarding SIGTERM (PRRTE's surekill, hard-coded), so the
serving processes are detached from it (see serve/supervisor.py) to be able to drain; and
a blocking socket read costs no CPU while idle, where MPI receives spin.

A dead peer closes its socket: rank 0 sees EOF on a worker's connection and a worker on
rank 0's, so the failure of any rank brings the job down within a second.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from runtime.plan import StepPlan
from runtime.wire import (
    dumps,
    loads,
    plan_from_wire,
    plan_to_wire,
    recv_exact,
    recv_frame,
    send_frame,
)

log = logging.getLogger("runtime.comm")
_RANK = struct.Struct("<I")
NONCE = 32
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Bootstrap:
    rank: int
    size: int
    local_rank: int
    local_size: int
    store_addr: str  # tcp://host:port for the torch process group's rendezvous
    plan_host: str
    plan_port: int
    secret: str = ""  # hex; made by rank 0 for this job, known only to its ranks

    ENV = "AOTLLM_BOOTSTRAP"

    def to_env(self) -> str:
        return ",".join(str(v) for v in (self.rank, self.size, self.local_rank, self.local_size,
                                         self.store_addr, self.plan_host, self.plan_port,
                                         self.secret))

    @classmethod
    def from_env(cls, value: str) -> Bootstrap:
        r, s, lr, ls, store, host, port, secret = value.split(",")
        return cls(int(r), int(s), int(lr), int(ls), store, host, int(port), secret)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def mpi_bootstrap(host: str = "127.0.0.1", listener: socket.socket | None = None
                  ) -> tuple[Bootstrap, socket.socket | None]:
    """Rank discovery over MPI; rank 0 also returns its listening plan socket (the one
    given, when its caller made it before MPI was up)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    addrs = None
    if rank == 0:
        if listener is None:
            listener = socket.create_server((host, 0), backlog=max(size, 8))
        addrs = (f"tcp://{host}:{_free_port(host)}", host, listener.getsockname()[1],
                 secrets.token_hex(32))
    store, plan_host, plan_port, secret = world.bcast(addrs, root=0)
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
    local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", size))
    boot = Bootstrap(rank, size, local_rank, local_size, store, plan_host, plan_port, secret)
    return boot, listener


def _mac(secret: bytes, role: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.new(secret, role + nonce + _RANK.pack(rank), hashlib.sha256).digest()


def _accept_peer(conn: socket.socket, secret: bytes, size: int) -> int:
    """Rank 0's side of the handshake; the peer's rank, or ConnectionError (refused)."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    challenge = secrets.token_bytes(NONCE)
    conn.sendall(challenge)
    (rank,) = _RANK.unpack(recv_exact(conn, _RANK.size))
    theirs = recv_exact(conn, NONCE)
    proof = recv_exact(conn, 32)
    if not 0 < rank < size or not hmac.compare_digest(proof, _mac(secret, b"peer", challenge, rank)):
        raise ConnectionError("the peer does not know this job's secret")
    conn.sendall(_mac(secret, b"leader", theirs, rank))
    conn.settimeout(None)
    return rank


def _connect_leader(sock: socket.socket, secret: bytes, rank: int, timeout_s: float) -> None:
    """A peer's side: prove we know the secret, and check that rank 0 does too. Rank 0
    may be busy refusing a stranger first, so this waits as long as connecting may."""
    sock.settimeout(timeout_s)
    challenge = recv_exact(sock, NONCE)
    mine = secrets.token_bytes(NONCE)
    sock.sendall(_RANK.pack(rank) + mine + _mac(secret, b"peer", challenge, rank))
    if not hmac.compare_digest(recv_exact(sock, 32), _mac(secret, b"leader", mine, rank)):
        raise ConnectionError("the plan port did not prove it is this job's rank 0")
    sock.settimeout(None)


class Comm:
    """One rank's end of the control plane. Size 1 needs no sockets at all."""

    def __init__(self, boot: Bootstrap | None = None, listener: socket.socket | None = None,
                 connect_timeout_s: float = 120.0) -> None:
        self.boot = boot or Bootstrap(0, 1, 0, 1, "", "", 0)
        self.rank, self.size = self.boot.rank, self.boot.size
        self._peers: list[socket.socket] = []  # rank 0: index r-1 is rank r
        self._leader: socket.socket | None = None  # ranks > 0
        if self.size == 1:
            return
        secret = bytes.fromhex(self.boot.secret)
        if len(secret) < 16:
            raise ValueError("the bootstrap carries no job secret; ranks cannot authenticate")
        if self.rank == 0:
            assert listener is not None, "rank 0 needs the listening plan socket"
            deadline = time.monotonic() + connect_timeout_s
            peers: dict[int, socket.socket] = {}
            while len(peers) < self.size - 1:
                listener.settimeout(max(0.01, deadline - time.monotonic()))
                conn, addr = listener.accept()  # socket.timeout (an OSError) past the deadline
                try:
                    rank = _accept_peer(conn, secret, self.size)
                    if rank in peers:
                        raise ConnectionError(f"rank {rank} is already connected")
                except (OSError, ConnectionError, struct.error) as e:
                    log.warning("refused a control-plane connection from %s: %s", addr, e)
                    conn.close()
                    continue
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peers[rank] = conn
            listener.close()
            self._peers = [peers[r] for r in range(1, self.size)]
        else:
            sock = socket.create_connection((self.boot.plan_host, self.boot.plan_port), connect_timeout_s)
            _connect_leader(sock, secret, self.rank, connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._leader = sock

    @classmethod
    def from_mpi(cls) -> Comm:
        """For a process mpirun started directly (build-time golden run, tests)."""
        if not any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK")):
            return cls()
        boot, listener = mpi_bootstrap()
        return cls(boot, listener)

    @property
    def local_rank(self) -> int:
        return self.boot.local_rank

    @property
    def local_size(self) -> int:
        return self.boot.local_size

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (JSON data: tuples come back as lists), in rank order."""
        if self.size == 1:
            return [loads(dumps(obj))]  # the same JSON round trip as with peers
        if self.rank == 0:
            items = [loads(dumps(obj)), *(loads(recv_frame(p)) for p in self._peers)]
            frame = dumps(items)
            for p in self._peers:
                send_frame(p, frame)
            return items
        assert self._leader is not None
        send_frame(self._leader, dumps(obj))
        return loads(recv_frame(self._leader))

    def init_process_group(self, backend: str) -> None:
        """The torch world group (default group, name "0", as compiled into engines)."""
        import torch.distributed as dist  # not at the top: the supervisor needs no torch

        if self.size == 1 or dist.is_initialized():
            return
        dist.init_process_group(backend, init_method=self.boot.store_addr, rank=self.rank,
                                world_size=self.size)

    def send_plan(self, plan: StepPlan) -> None:
        if self.size == 1:
            return
        data = plan_to_wire(plan)
        for p in self._peers:
            send_frame(p, data)

    def recv_plan(self) -> StepPlan:
        assert self._leader is not None
        return plan_from_wire(recv_frame(self._leader))

    def watch_peers(self, on_failure: Callable[[str], None]) -> None:
        """Rank 0, after start-up: a thread that reports the first worker to disconnect.

        Workers never send after start-up, so a readable socket means EOF: a dead rank.
        """
        if self.rank != 0 or self.size == 1:
            return

        def watch() -> None:
            socks = {p.fileno(): r for r, p in enumerate(self._peers, start=1)}
            readable, _, _ = select.select(list(socks), [], [])
            on_failure(f"rank {socks[readable[0]]} disconnected (the process died or failed)")

        threading.Thread(target=watch, name="peer-watch", daemon=True).start()

    def close(self) -> None:
        """Close the sockets and destroy the process group, which joins its worker threads.

        Without this, a gloo worker thread can still be releasing a tensor while the
        interpreter finalizes, and the process aborts at exit (pthread_exit inside
        PyEval_AcquireThread: about one exit in five after collectives, measured).
        """
        for s in (*self._peers, self._leader):
            if s is not None:
                s.close()
        self._peers, self._leader = [], None
        dist = _dist()
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


def _dist() -> Any:
    """torch.distributed when this process has imported torch (else nothing to destroy)."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    return dist


def finish(code: int, comm: Comm | None = None) -> NoReturn:
    """End a process that may have used collectives and MPI: deterministically.

    The process group is destroyed first (its threads joined), MPI is finalized when this
    process initialized it (mpirun counts a rank that exits without MPI_Finalize as
    failed), and the interpreter is left with os._exit so that no library thread can run
    into interpreter finalization.
    """
    if comm is not None:
        comm.close()
    elif (dist := _dist()) is not None and dist.is_initialized():
        dist.destroy_process_group()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
