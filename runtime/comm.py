"""The control plane and the data plane of one TP job.

MPI only bootstraps: it says who is rank 0 and carries rank 0's addresses to the others.
After that, plain TCP carries the control plane (each step's pickled plan from rank 0,
start-up all-gathers) and a torch process group (gloo on CPU, NCCL on CUDA) carries the
collectives compiled into the model. Why not MPI for the steps: Open MPI 5's launcher
SIGKILLs its ranks 0.5 s after forwarding SIGTERM (PRRTE's surekill, hard-coded), so the
serving processes are detached from it (see serve/supervisor.py) to be able to drain; and
a blocking socket read costs no CPU while idle, where MPI receives spin.

A dead peer closes its socket: rank 0 sees EOF on a worker's connection and a worker on
rank 0's, so the failure of any rank brings the job down within a second.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from runtime.plan import StepPlan

_LEN = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Bootstrap:
    rank: int
    size: int
    local_rank: int
    local_size: int
    store_addr: str  # tcp://host:port for the torch process group's rendezvous
    plan_host: str
    plan_port: int

    ENV = "AOTLLM_BOOTSTRAP"

    def to_env(self) -> str:
        return ",".join(str(v) for v in (self.rank, self.size, self.local_rank, self.local_size,
                                         self.store_addr, self.plan_host, self.plan_port))

    @classmethod
    def from_env(cls, value: str) -> Bootstrap:
        r, s, lr, ls, store, host, port = value.split(",")
        return cls(int(r), int(s), int(lr), int(ls), store, host, int(port))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def mpi_bootstrap(host: str = "127.0.0.1") -> tuple[Bootstrap, socket.socket | None]:
    """Rank discovery over MPI; rank 0 also returns its listening plan socket."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    listener = None
    addrs = None
    if rank == 0:
        listener = socket.create_server((host, 0), backlog=max(size, 8))
        addrs = (f"tcp://{host}:{_free_port(host)}", host, listener.getsockname()[1])
    store, plan_host, plan_port = world.bcast(addrs, root=0)
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
    local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", size))
    return Bootstrap(rank, size, local_rank, local_size, store, plan_host, plan_port), listener


def _send_obj(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the control connection")
        got += k
    return bytes(buf)


def _recv_obj(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return pickle.loads(_recv_exact(sock, n))


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
        if self.rank == 0:
            assert listener is not None, "rank 0 needs the listening plan socket"
            listener.settimeout(connect_timeout_s)
            peers: dict[int, socket.socket] = {}
            while len(peers) < self.size - 1:
                conn, _ = listener.accept()
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peers[_recv_obj(conn)] = conn
            listener.close()
            self._peers = [peers[r] for r in range(1, self.size)]
        else:
            sock = socket.create_connection((self.boot.plan_host, self.boot.plan_port), connect_timeout_s)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_obj(sock, self.rank)
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
        if self.size == 1:
            return [obj]
        if self.rank == 0:
            items = [obj, *(_recv_obj(p) for p in self._peers)]
            for p in self._peers:
                _send_obj(p, items)
            return items
        assert self._leader is not None
        _send_obj(self._leader, obj)
        return _recv_obj(self._leader)

    def init_process_group(self, backend: str) -> None:
        """The torch world group (default group, name "0", as compiled into engines)."""
        if self.size == 1 or dist.is_initialized():
            return
        dist.init_process_group(backend, init_method=self.boot.store_addr, rank=self.rank,
                                world_size=self.size)

    def send_plan(self, plan: StepPlan) -> None:
        if self.size == 1:
            return
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _LEN.pack(len(data)) + data
        for p in self._peers:
            p.sendall(frame)

    def recv_plan(self) -> StepPlan:
        assert self._leader is not None
        return _recv_obj(self._leader)

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
        for s in (*self._peers, self._leader):
            if s is not None:
                s.close()
        if dist.is_initialized():
            dist.destroy_process_group()
