"""The control plane and the data plane of one TP job.

MPI only bootstraps: it says who is rank 0 and carries rank 0's addresses and a fresh
secret to the others. After that, plain TCP carries the control plane (each step's plan
from rank 0, start-up all-gathers, as JSON frames: runtime/dist/wire.py) and a torch process
group (gloo on CPU, NCCL on CUDA) carries the collectives compiled into the model.

The plan port is open on the host during start-up, so a peer must prove it knows the
secret (HMAC challenge-response, both ways) before anything it sends is read; a stranger
is refused and start-up goes on waiting for the real ranks. Why not MPI for the steps: Open MPI 5's launcher
SIGKILLs its ranks 0.5 s after forwarding SIGTERM (PRRTE's surekill, hard-coded), so the
serving processes are detached from it (see serve/supervisor.py) to be able to drain; and
a blocking socket read costs no CPU while idle, where MPI receives spin.

Across hosts (runtime/dist/netif.py chooses the addresses): rank 0's plan port and the rendezvous
store listen on rank 0's comm address only (loopback when every rank is on one host), gloo
binds each rank's comm interface (GLOO_SOCKET_IFNAME), and each rank knows every rank's host.

A dead peer closes its socket: rank 0 sees EOF on a worker's connection and a worker on
rank 0's, so the failure of any rank brings the job down within a second. A host that drops
off the network closes nothing: TCP keepalive probes and a user timeout on every control
connection turn its silence into an error within PEER_TIMEOUT_S, and `watch` (a thread on
every rank, from the connection on) ends the job naming the rank and its host.
"""

from __future__ import annotations

import datetime
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from typing import Any, NoReturn

import torch.distributed as dist

from runtime.dist.bootstrap import (
    CONNECT_TRY_S,
    Bootstrap,
    Listeners,
    PeerLost,
    RankHost,
    accept_peer,
    connect_leader,
    describe_failure,
    keepalive,
    mpi_bootstrap,
)
from runtime.dist.netif import asked_ifaces, iface_of, order_for_peer, this_host
from runtime.dist.peerwatch import PeerWatch
from runtime.core.plan import StepPlan
from runtime.dist.wire import (
    dumps,
    loads,
    plan_from_wire,
    plan_to_wire,
    recv_frame,
    send_frame,
)

log = logging.getLogger("runtime.dist.comm")
# Gloo's per-operation timeout (and the store's): a collective waits this long for a peer.
PG_TIMEOUT_S = 120.0


class Comm:
    """One rank's end of the control plane. Size 1 needs no sockets at all."""

    def __init__(self, boot: Bootstrap | None = None,
                 listeners: Listeners | socket.socket | None = None,
                 connect_timeout_s: float = 120.0) -> None:
        self.boot = boot or Bootstrap(0, 1, 0, 1, "", "", 0)
        self.rank, self.size = self.boot.rank, self.boot.size
        if isinstance(listeners, socket.socket):
            listeners = Listeners([listeners])
        self._peers: list[socket.socket] = []  # rank 0: index r-1 is rank r
        self._leader: socket.socket | None = None  # ranks > 0
        self._store_listener: socket.socket | None = None
        self.store_addr = ""
        self._hosts: tuple[RankHost, ...] = ()
        self.peer_watch = PeerWatch(self.rank, self.size, self._who)
        if self.size == 1:
            return
        secret = bytes.fromhex(self.boot.secret)
        if len(secret) < 16:
            raise ValueError("the bootstrap carries no job secret; ranks cannot authenticate")
        if self.rank == 0:
            assert listeners is not None, "rank 0 needs the listening plan socket"
            used = self._accept_all(listeners, secret, connect_timeout_s)
            # The address most peers reached is this rank's comm address.
            addr = max(set(used), key=used.count)
            why = (f"reached by the other rank(s) at {addr}" if not self.boot.comm_iface
                   else f"--comm-iface {self.boot.comm_iface}")
        else:
            self._leader = self._connect(secret, connect_timeout_s)
            addr = self._leader.getsockname()[0]
            peer = self._leader.getpeername()[0]
            why = (f"the route to rank 0 at {peer}" if not self.boot.comm_iface
                   else f"--comm-iface {self.boot.comm_iface}")
        self.peer_watch.connected(self._peers, self._leader)
        self._exchange_hosts(addr, why)

    def _accept_all(self, listeners: Listeners, secret: bytes, timeout_s: float) -> list[str]:
        """Rank 0: every peer, authenticated, from any of the listening addresses; the local
        address each connection arrived at."""
        deadline = time.monotonic() + timeout_s
        peers: dict[int, socket.socket] = {}
        used: list[str] = []
        while len(peers) < self.size - 1:
            ready, _, _ = select.select(listeners.plans, [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = [r for r in range(1, self.size) if r not in peers]
                raise PeerLost(f"rank(s) {', '.join(map(str, missing))} did not connect within "
                               f"{timeout_s:.0f} s")
            for listener in ready:
                conn, addr = listener.accept()
                try:
                    rank = accept_peer(conn, secret, self.size)
                    if rank in peers:
                        raise ConnectionError(f"rank {rank} is already connected")
                except (OSError, ConnectionError, struct.error) as e:
                    log.warning("refused a control-plane connection from %s: %s", addr, e)
                    conn.close()
                    continue
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keepalive(conn)
                peers[rank] = conn
                used.append(conn.getsockname()[0])
        listeners.close()
        self._peers = [peers[r] for r in range(1, self.size)]
        return used

    def _connect(self, secret: bytes, timeout_s: float) -> socket.socket:
        """A peer: rank 0's addresses in route order (runtime/dist/netif.py), the first that
        answers; from the interface asked for, if one was."""
        asked = asked_ifaces(self.boot.comm_iface or None)
        source = (asked[0].addr, 0) if asked else None
        tried: list[str] = []
        for addr, port in order_for_peer(self.boot.leader_addrs(), list(this_host().ifaces)):
            try:
                sock = socket.create_connection((addr, port), min(timeout_s, CONNECT_TRY_S),
                                                source_address=source)
            except OSError as e:
                tried.append(f"{addr}:{port} ({e.strerror or e})")
                continue
            connect_leader(sock, secret, self.rank, timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keepalive(sock)
            return sock
        raise PeerLost(f"cannot reach rank 0 at any of its addresses: {'; '.join(tried)}")

    def _exchange_hosts(self, addr: str, why: str) -> None:
        """Every rank's host and comm address, in rank order, on every rank; rank 0 also
        opens the rendezvous store on its comm address and says where it is."""
        me = this_host()
        mine = {"hostname": me.hostname, "key": me.key, "addr": addr,
                "iface": iface_of(addr, list(me.ifaces)), "why": why}
        if self.rank == 0:
            items = [mine, *(self._recv_from(r, p) for r, p in enumerate(self._peers, start=1))]
            self._store_listener = socket.create_server((addr, 0), backlog=max(self.size, 64))
            self.store_addr = f"{addr}:{self._store_listener.getsockname()[1]}"
            frame = dumps({"hosts": items, "store": self.store_addr})
            for p in self._peers:
                send_frame(p, frame)
        else:
            assert self._leader is not None
            send_frame(self._leader, dumps(mine))
            reply = self._recv_from(0, self._leader)
            items, self.store_addr = reply["hosts"], reply["store"]
        self._hosts = tuple(RankHost(h["hostname"], h["key"], h["iface"], h["addr"], h["why"])
                            for h in items)

    @classmethod
    def from_mpi(cls) -> Comm:
        """For a process mpirun started directly (build-time golden run, tests)."""
        if not any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK")):
            return cls()
        boot, listeners = mpi_bootstrap()
        return cls(boot, listeners)

    @property
    def local_rank(self) -> int:
        return self.boot.local_rank

    @property
    def local_size(self) -> int:
        return self.boot.local_size

    # ---- topology ----------------------------------------------------------------------

    @property
    def hosts(self) -> tuple[RankHost, ...]:
        return self._hosts

    def host_of(self, rank: int) -> RankHost | None:
        return self._hosts[rank] if rank < len(self._hosts) else None

    def _who(self, rank: int) -> str:
        h = self.host_of(rank)
        return f"rank {rank} on {h.label()}" if h is not None else f"rank {rank}"

    def host_label(self, rank: int) -> str:
        h = self.host_of(rank)
        return h.label() if h is not None else socket.gethostname()

    @property
    def num_hosts(self) -> int:
        return len({h.key for h in self._hosts}) or 1

    def topology(self) -> dict[str, Any]:
        """For reports: the hosts, the ranks on each and the interface each rank binds."""
        by_key: dict[str, dict[str, Any]] = {}
        for r, h in enumerate(self._hosts):
            by_key.setdefault(h.key, {"host": h.hostname, "ranks": []})["ranks"].append(
                {"rank": r, **h.to_dict()})
        return {"hosts": len(by_key) or 1, "by_host": list(by_key.values())}

    # ---- the control plane -------------------------------------------------------------

    def _recv_from(self, rank: int, sock: socket.socket) -> Any:
        try:
            return loads(recv_frame(sock))
        except (OSError, ConnectionError) as e:
            raise PeerLost(f"{self._who(rank)}: {describe_failure(e, sock)}") from None

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (JSON data: tuples come back as lists), in rank order."""
        if self.size == 1:
            return [loads(dumps(obj))]  # the same JSON round trip as with peers
        if self.rank == 0:
            items = [loads(dumps(obj)),
                     *(self._recv_from(r, p) for r, p in enumerate(self._peers, start=1))]
            frame = dumps(items)
            for p in self._peers:
                send_frame(p, frame)
            return items
        assert self._leader is not None
        send_frame(self._leader, dumps(obj))
        return self._recv_from(0, self._leader)

    def init_process_group(self, backend: str) -> None:
        """The torch world group (default group, name "0", as compiled into engines), bound
        to this rank's comm interface; the store listens on rank 0's comm address only."""
        if self.size == 1 or dist.is_initialized():
            return
        me = self.host_of(self.rank)
        if me is not None:
            # gloo binds the interface named here (torch reads it when the group is made);
            # a user's own GLOO_SOCKET_IFNAME wins (it may list several).
            os.environ.setdefault("GLOO_SOCKET_IFNAME", me.iface)
            if self.num_hosts > 1:
                os.environ.setdefault("NCCL_SOCKET_IFNAME", me.iface)
        host, _, port = self.store_addr.rpartition(":")
        timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
        if self.rank == 0 and self._store_listener is not None:
            store = dist.TCPStore(host, int(port), self.size, True, timeout=timeout,
                                  wait_for_workers=False,
                                  master_listen_fd=self._store_listener.fileno())
        else:
            store = dist.TCPStore(host, int(port), self.size, self.rank == 0, timeout=timeout,
                                  wait_for_workers=False)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size,
                                timeout=timeout)
        self._store = store  # the process group keeps a prefixed view; keep the root alive

    def send_plan(self, plan: StepPlan) -> None:
        if self.size == 1:
            return
        if plan.shutdown:
            self.peer_watch.expect_end()
        data = plan_to_wire(plan)
        for p in self._peers:
            send_frame(p, data)

    def recv_plan(self) -> StepPlan:
        assert self._leader is not None
        try:
            plan = plan_from_wire(recv_frame(self._leader))
        except (OSError, ConnectionError) as e:
            raise PeerLost(f"{self._who(0)}: {describe_failure(e, self._leader)}") from None
        if plan.shutdown:
            self.peer_watch.expect_end()
        return plan

    def close(self) -> None:
        """Close the sockets and destroy the process group, which joins its worker threads.

        Without this, a gloo worker thread can still be releasing a tensor while the
        interpreter finalizes, and the process aborts at exit (pthread_exit inside
        PyEval_AcquireThread: about one exit in five after collectives, measured).
        """
        self.peer_watch.expect_end()
        for s in (*self._peers, self._leader, self._store_listener):
            if s is not None:
                s.close()
        self._peers, self._leader, self._store_listener = [], None, None
        if dist.is_initialized():
            dist.destroy_process_group()


def finish(code: int, comm: Comm | None = None) -> NoReturn:
    """End a process that may have used collectives and MPI: deterministically.

    The process group is destroyed first (its threads joined), MPI is finalized when this
    process initialized it (mpirun counts a rank that exits without MPI_Finalize as
    failed), and the interpreter is left with os._exit so that no library thread can run
    into interpreter finalization.
    """
    if comm is not None:
        comm.close()
    elif dist.is_initialized():
        dist.destroy_process_group()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
