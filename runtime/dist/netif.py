"""Which host a rank is on, and which of its addresses reaches the other ranks.

A TP job's control plane (rank 0's plan port), the torch process group's rendezvous store
and gloo's own connections must bind an address the other ranks can reach: loopback when
every rank is on one host, else the interface on the path between the hosts. The path is
found by the control plane's own connections (runtime/dist/comm.py):

- Rank 0 listens on each candidate address (`listen_candidates`): those of the interface
  asked for (`--comm-iface`, else the conventional `GLOO_SOCKET_IFNAME` or
  `NCCL_SOCKET_IFNAME`: names matched exactly or else as a prefix, as NCCL does; a leading
  `^` excludes, a leading `=` is ignored), else loopback when every rank is on this host,
  else every up IPv4 interface but loopback and `docker*` bridges (the same subnet exists on
  every host, so it reaches none of them).
- Each other rank tries rank 0's addresses in the order `order_for_peer` gives: a subnet it
  shares first (one private network between the hosts, the common case), then those the
  kernel routes through a non-loopback interface, never one of its own addresses.
- The address a connection used is each side's comm address; its interface is the one gloo
  binds (GLOO_SOCKET_IFNAME) and the store listens on rank 0's.

A "host" is a network endpoint: the hostname, the boot and the network namespace. Ranks
in two network namespaces of one machine (the two-host test) are two hosts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_NAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFFLAGS, _SIOCGIFADDR, _SIOCGIFNETMASK = 0x8913, 0x8915, 0x891B
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8
_SKIPPED_PREFIXES = ("docker",)  # a bridge of containers: same subnet on every host


class InterfaceError(RuntimeError):
    """No interface fits: the message names the host, what it has and how to choose."""


@dataclass(frozen=True, slots=True)
class Iface:
    name: str
    addr: str
    prefix: int
    loopback: bool = False

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"{self.addr}/{self.prefix}", strict=False)

    def to_wire(self) -> list[Any]:
        return [self.name, self.addr, self.prefix, self.loopback]

    @classmethod
    def from_wire(cls, v: list[Any]) -> Iface:
        return cls(str(v[0]), str(v[1]), int(v[2]), bool(v[3]))


@dataclass(frozen=True, slots=True)
class HostInfo:
    """What one rank says about its host, before any choice is made."""

    key: str  # equal on ranks of one host
    hostname: str
    ifaces: tuple[Iface, ...] = field(default_factory=tuple)

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key, "hostname": self.hostname,
                "ifaces": [i.to_wire() for i in self.ifaces]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> HostInfo:
        return cls(str(d["key"]), str(d["hostname"]),
                   tuple(Iface.from_wire(v) for v in d.get("ifaces", ())))


def _ioctl_addr(sock: socket.socket, request: int, name: str) -> str | None:
    try:
        res = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(res[20:24])


def interfaces() -> list[Iface]:
    """This host's up IPv4 interfaces (one address each: the primary one)."""
    out: list[Iface] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            flags = struct.unpack("H", raw[16:18])[0]
            if not flags & _IFF_UP:
                continue
            addr = _ioctl_addr(s, _SIOCGIFADDR, name)
            mask = _ioctl_addr(s, _SIOCGIFNETMASK, name)
            if addr is None or mask is None:
                continue
            prefix = ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen
            out.append(Iface(name, addr, prefix, bool(flags & _IFF_LOOPBACK)))
    return out


def host_key() -> str:
    """Equal for processes that share a host: hostname, boot and network namespace."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/net"))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def this_host() -> HostInfo:
    return HostInfo(host_key(), socket.gethostname(), tuple(interfaces()))


def requested(explicit: str | None = None) -> tuple[str, str] | None:
    """The explicit interface choice and where it came from, or None (choose automatically)."""
    if explicit:
        return explicit, "--comm-iface"
    for name in ENV_NAMES:
        value = os.environ.get(name, "").strip()
        if value:
            return value, name
    return None


def _matching(ifaces: list[Iface], spec: str) -> list[Iface]:
    """`spec` as GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME take it (see the module doc)."""
    spec = spec.strip().lstrip("=")
    exclude = spec.startswith("^")
    names = [n.strip() for n in spec.lstrip("^").split(",") if n.strip()]

    def hit(i: Iface) -> bool:
        return any(i.name == n or i.name.startswith(n) for n in names)

    if exclude:
        return [i for i in ifaces if not hit(i)]
    exact = [i for n in names for i in ifaces if i.name == n]
    return exact or [i for i in ifaces if hit(i)]


def describe(ifaces: list[Iface]) -> str:
    return ", ".join(f"{i.name} {i.addr}/{i.prefix}" for i in ifaces) or "no IPv4 interface"


def asked_ifaces(explicit: str | None, ifaces: list[Iface] | None = None) -> list[Iface] | None:
    """This host's interfaces the explicit choice names, None when there is none; raises
    InterfaceError when it names none of this host's."""
    asked = requested(explicit)
    if asked is None:
        return None
    ifaces = interfaces() if ifaces is None else ifaces
    found = _matching(ifaces, asked[0])
    if not found:
        raise InterfaceError(f"no interface of host {socket.gethostname()} matches {asked[1]}="
                             f"{asked[0]!r} (it has {describe(ifaces)})")
    return found


def listen_candidates(explicit: str | None, one_host: bool,
                      ifaces: list[Iface] | None = None) -> list[Iface]:
    """The addresses rank 0 listens on for the other ranks (see the module doc)."""
    ifaces = interfaces() if ifaces is None else ifaces
    asked = asked_ifaces(explicit, ifaces)
    if asked is not None:
        return asked
    lo = next((i for i in ifaces if i.loopback), Iface("lo", "127.0.0.1", 8, True))
    if one_host:
        return [Iface(lo.name, "127.0.0.1", 8, True)]
    out = [i for i in ifaces if not i.loopback and not i.name.startswith(_SKIPPED_PREFIXES)]
    if not out:
        raise InterfaceError(f"host {socket.gethostname()} has no interface to reach other hosts "
                             f"({describe(ifaces)}); choose one with --comm-iface")
    return out


def route_source(addr: str) -> str | None:
    """The local address the kernel would send from to reach `addr` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def order_for_peer(leader: list[tuple[str, int]], mine: list[Iface]) -> list[tuple[str, int]]:
    """Rank 0's listening addresses in the order a rank on another host should try them:
    a shared subnet first, then those routed through a non-loopback interface; never an
    address this host has itself (a bridge both hosts have), loopback only when rank 0
    offers nothing else."""
    own = {i.addr for i in mine}
    scored = []
    for n, (addr, port) in enumerate(leader):
        ip = ipaddress.ip_address(addr)
        if addr in own and not ip.is_loopback:
            continue
        if any(not i.loopback and ip in i.network for i in mine):
            rank = 0
        elif ip.is_loopback:
            rank = 3
        else:
            src = route_source(addr)
            rank = 1 if src is not None and not ipaddress.ip_address(src).is_loopback else 2
        scored.append((rank, n, (addr, port)))
    return [a for _, _, a in sorted(scored)]


def iface_of(addr: str, ifaces: list[Iface] | None = None) -> str:
    """The name of the interface that holds `addr` here ("?" when none does)."""
    ifaces = interfaces() if ifaces is None else ifaces
    if ipaddress.ip_address(addr).is_loopback:
        return next((i.name for i in ifaces if i.loopback), "lo")
    return next((i.name for i in ifaces if i.addr == addr), "?")
