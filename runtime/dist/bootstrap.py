"""How the ranks of a TP job find each other: MPI carries rank 0's addresses and a fresh
secret to every rank (`mpi_bootstrap`), then each rank > 0 connects to rank 0 over TCP and
both sides prove they know the secret (HMAC challenge-response, both ways) before anything
is read. Also the socket options and the words for a failed control connection.

Several hosts: rank 0 listens on each candidate address (runtime/dist/netif.py) and hands them
all out; the MPI runtime's name service carries them, not MPI point-to-point traffic, so
nothing depends on the MPI library's own choice of interfaces.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from runtime.env import PEER_TIMEOUT, RENDEZVOUS, number
from runtime.dist.netif import InterfaceError, host_key, listen_candidates
from runtime.dist.wire import recv_exact

_RANK = struct.Struct("<I")
NONCE = 32
HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TRY_S = 5.0  # per address of rank 0 a peer tries
PEER_TIMEOUT_ENV = PEER_TIMEOUT.name
# A peer that stops answering (its host powered off, a cable or a route gone) is declared
# dead after this many seconds without an acknowledgement or a keepalive reply.
PEER_TIMEOUT_S = number(PEER_TIMEOUT)
SILENT = "stopped answering"

@dataclass(frozen=True, slots=True)
class RankHost:
    """Where one rank runs and the interface its side of the job is bound to."""

    hostname: str
    key: str  # equal for ranks of one host (runtime/dist/netif.py)
    iface: str
    addr: str
    why: str = ""

    def label(self) -> str:
        return self.hostname if self.addr.startswith("127.") else f"{self.hostname} ({self.addr})"

    def to_dict(self) -> dict[str, str]:
        return {"hostname": self.hostname, "iface": self.iface, "addr": self.addr,
                "chosen_by": self.why}


@dataclass(frozen=True, slots=True)
class Bootstrap:
    rank: int
    size: int
    local_rank: int
    local_size: int
    store_addr: str  # unused: rank 0 makes the store on its comm address once connected
    plan_host: str
    plan_port: int
    secret: str = ""  # hex; made by rank 0 for this job, known only to its ranks
    plan_addrs: tuple[tuple[str, int], ...] = ()  # every address rank 0 listens on
    comm_iface: str = ""  # the interface asked for (--comm-iface); "" chooses by route

    def to_json(self) -> str:
        return json.dumps([self.rank, self.size, self.local_rank, self.local_size,
                           self.store_addr, self.plan_host, self.plan_port, self.secret,
                           [list(a) for a in self.plan_addrs], self.comm_iface])

    @classmethod
    def from_json(cls, value: str) -> Bootstrap:
        r, s, lr, ls, store, host, port, secret, addrs, iface = json.loads(value)
        return cls(int(r), int(s), int(lr), int(ls), store, host, int(port), secret,
                   tuple((str(a), int(p)) for a, p in addrs), iface)

    def leader_addrs(self) -> list[tuple[str, int]]:
        return list(self.plan_addrs) or [(self.plan_host, self.plan_port)]


@dataclass
class Listeners:
    """Rank 0's listening plan sockets (one per candidate address), bound at the bootstrap."""

    plans: list[socket.socket]

    def fds(self) -> list[int]:
        return [s.fileno() for s in self.plans]

    def close(self) -> None:
        for s in self.plans:
            s.close()


class PeerLost(ConnectionError):
    """A peer's control connection failed; the message names the rank and its host."""


RENDEZVOUS_ENV = RENDEZVOUS.name  # "mpi" forces MPI collectives for the bootstrap
LOOKUP_TIMEOUT_S = 120.0


def _one_host(world: Any) -> bool:
    """Whether mpirun placed every rank on one node (Open MPI says so in the environment)."""
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if local is not None:
        return int(local) == world.Get_size()
    return len(set(world.allgather(host_key()))) == 1


def _rendezvous(world: Any, info: dict[str, Any] | None, one_host: bool) -> dict[str, Any]:
    """Rank 0's `info` on every rank. One host: an MPI broadcast. Several hosts: through
    the MPI runtime's name service (MPI_Publish_name/Lookup_name, PMIx under Open MPI 5),
    which travels between mpirun's daemons and needs no MPI point-to-point traffic between
    the ranks, so no assumption about the MPI library's own choice of interfaces (set
    AOTLLM_RENDEZVOUS=mpi for a broadcast on an MPI without a name service)."""
    from mpi4py import MPI

    if one_host or RENDEZVOUS.raw() == "mpi":
        return world.bcast(info, root=0)
    job = os.environ.get("PMIX_NAMESPACE", "job")
    service = f"aotllm-bootstrap-{job}"
    if world.Get_rank() == 0:
        MPI.Publish_name(service, json.dumps(info))
        return info  # type: ignore[return-value]
    deadline = time.monotonic() + LOOKUP_TIMEOUT_S
    while True:
        try:
            return json.loads(MPI.Lookup_name(service))
        except MPI.Exception:
            if time.monotonic() > deadline:
                raise PeerLost(f"rank 0 published no address within {LOOKUP_TIMEOUT_S:.0f} s "
                               "(MPI_Lookup_name)") from None
            time.sleep(0.05)


def mpi_bootstrap(comm_iface: str | None = None) -> tuple[Bootstrap, Listeners | None]:
    """Rank discovery over MPI: rank 0 listens on its candidate addresses (runtime/dist/netif.py)
    and hands them, with a fresh secret, to every rank; the ranks' connections then decide
    which interfaces the job uses (Comm). Raises InterfaceError on every rank when rank 0
    has no address to offer (e.g. --comm-iface names no interface of its host)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    one_host = _one_host(world)
    listeners = None
    info: dict[str, Any] | None = None
    if rank == 0:
        try:
            cands = listen_candidates(comm_iface, one_host)
            plans = [socket.create_server((i.addr, 0), backlog=max(size, 8)) for i in cands]
            listeners = Listeners(plans)
            info = {"secret": secrets.token_hex(32),
                    "addrs": [[i.addr, p.getsockname()[1]] for i, p in zip(cands, plans)]}
        except (InterfaceError, OSError) as e:
            info = {"error": str(e)}
    info = _rendezvous(world, info, one_host)
    if "error" in info:
        if listeners is not None:
            listeners.close()
        raise InterfaceError(f"rank 0: {info['error']}")
    addrs = tuple((str(a), int(p)) for a, p in info["addrs"])
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
    local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", size))
    boot = Bootstrap(rank, size, local_rank, local_size, "", addrs[0][0], addrs[0][1],
                     info["secret"], addrs, comm_iface or "")
    return boot, listeners


def keepalive(sock: socket.socket, timeout_s: float = PEER_TIMEOUT_S) -> None:
    """Make a silent peer an error within about `timeout_s`: keepalive probes every second
    once idle for a second, and (Linux) a user timeout for unacknowledged data, which also
    bounds the probes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1),
                       ("TCP_KEEPCNT", max(1, int(timeout_s))),
                       ("TCP_USER_TIMEOUT", int(timeout_s * 1000))):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _mac(secret: bytes, role: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.new(secret, role + nonce + _RANK.pack(rank), hashlib.sha256).digest()


def accept_peer(conn: socket.socket, secret: bytes, size: int) -> int:
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


def connect_leader(sock: socket.socket, secret: bytes, rank: int, timeout_s: float) -> None:
    """A peer's side: prove we know the secret, and check that rank 0 does too. Rank 0
    may be busy refusing a stranger first, so this waits as long as connecting may."""
    sock.settimeout(timeout_s)
    challenge = recv_exact(sock, NONCE)
    mine = secrets.token_bytes(NONCE)
    sock.sendall(_RANK.pack(rank) + mine + _mac(secret, b"peer", challenge, rank))
    if not hmac.compare_digest(recv_exact(sock, 32), _mac(secret, b"leader", mine, rank)):
        raise ConnectionError("the plan port did not prove it is this job's rank 0")
    sock.settimeout(None)


def describe_failure(err: BaseException | None, sock: socket.socket) -> str:
    """Why a control connection failed, in words a person can act on."""
    code = 0
    with contextlib.suppress(OSError):
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if isinstance(err, OSError) and err.errno:
        code = code or err.errno
    if code in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
        return (f"{SILENT} ({os.strerror(code)}; no reply within {PEER_TIMEOUT_S:.0f} s: "
                "its host is down or the network between the hosts is cut)")
    if code:
        return f"connection failed ({os.strerror(code)})"
    return "disconnected (the process died or failed)"
