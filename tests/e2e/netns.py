"""Two "hosts" on one machine: two network namespaces joined by a veth pair (needs root).

Each namespace has its own loopback and one address (10.77.0.1 and 10.77.0.2 on a /24),
so anything that binds 127.0.0.1 and is reached from the other "host" breaks, as it
would across machines. mpirun runs in host A; its ssh agent is a script that runs the
command in the namespace of the address it is given (and may pin each "host" to its own
CPU core, like two one-core machines). The files are shared (one file system), except
what a test hides from host B with a bind mount in B's own mount namespace
(`ip netns exec` gives every command one).

The test process itself stays in the root namespace: a relay on its loopback carries the
client's HTTP connections to rank 0's server inside host A (a thread that entered A's
namespace opens each upstream connection; a socket keeps the namespace it was made in).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import secrets
import shlex
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"
_CLONE_NEWNET = 0x40000000


NS_PREFIX = "aotllm-"


def sweep_stale() -> None:
    """Delete the namespaces of runs whose process is gone (their veth pair goes with them)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        pid = name.removeprefix(NS_PREFIX).split("-")[0]
        if name.startswith(NS_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"aotllm-probe-{secrets.token_hex(3)}"
    try:
        proc = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    if proc.returncode != 0:
        return f"`ip netns add` is not permitted here: {proc.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class TwoHosts:
    """The namespaces, the veth pair and the agent script; `close` removes all of them."""

    workdir: Path
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    pin_cores: bool = False  # each "host" on one CPU core of its own (benchmarks)

    def __post_init__(self) -> None:
        sweep_stale()
        # The creator's pid in the name: parallel runs never collide, and a run killed
        # before its cleanup (SIGKILL) leaves namespaces the next run can recognize.
        prefix = f"{NS_PREFIX}{os.getpid()}-{self.tag}"
        self.ns_a, self.ns_b = f"{prefix}-a", f"{prefix}-b"
        self.if_a, self.if_b = f"aot{self.tag}a", f"aot{self.tag}b"  # at most 15 characters
        self.mounts_b: list[tuple[Path, Path]] = []  # (source, target) bind mounts on host B
        self.agent = self.workdir / "agent"
        created: list[str] = []
        try:
            for ns in (self.ns_a, self.ns_b):
                _ip("netns", "add", ns)
                created.append(ns)
            _ip("link", "add", self.if_a, "type", "veth", "peer", "name", self.if_b)
            _ip("link", "set", self.if_a, "netns", self.ns_a)
            _ip("link", "set", self.if_b, "netns", self.ns_b)
            for ns, dev, addr in ((self.ns_a, self.if_a, ADDR_A), (self.ns_b, self.if_b, ADDR_B)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            for ns in created:
                _ip("netns", "del", ns, check=False)
            raise
        self.write_agent()

    def write_agent(self) -> None:
        """mpirun's plm_ssh_agent: `agent HOST CMD...` runs CMD in HOST's namespace."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        pin_a = "taskset -c 0 " if self.pin_cores else ""
        pin_b = f"taskset -c {1 if (os.cpu_count() or 1) > 1 else 0} " if self.pin_cores else ""
        mounts = "".join(f"mount --bind {shlex.quote(str(s))} {shlex.quote(str(t))} && "
                         for s, t in self.mounts_b)
        self.agent.write_text(
            "#!/bin/sh\n"
            "# mpirun's ssh agent for the two-namespace test: run the command on that 'host'\n"
            f'case "$1" in\n'
            f'  {ADDR_A}) shift; exec ip netns exec {self.ns_a} {pin_a}sh -c "$*" ;;\n'
            f'  {ADDR_B}) shift; exec ip netns exec {self.ns_b} {pin_b}sh -c '
            f'"{mounts}$*" ;;\n'
            '  *) echo "agent: unknown host $1" >&2; exit 1 ;;\n'
            "esac\n")
        self.agent.chmod(0o755)

    def hide_on_b(self, source: Path, target: Path) -> None:
        """Host B sees `source` at `target` (its own storage differs from A's)."""
        self.mounts_b.append((source, target))
        self.write_agent()

    def clear_mounts(self) -> None:
        self.mounts_b.clear()
        self.write_agent()

    def prefix_a(self) -> list[str]:
        """Run a command on host A (where mpirun, the launcher and rank 0 run)."""
        return ["ip", "netns", "exec", self.ns_a,
                *(["taskset", "-c", "0"] if self.pin_cores else [])]

    def launch_args(self) -> tuple[str, ...]:
        """`serve launch` flags that start one rank on each host through the agent."""
        return ("--hosts", f"{ADDR_A}:1,{ADDR_B}:1", "--mpirun-arg=--prtemca",
                "--mpirun-arg=plm_ssh_agent", f"--mpirun-arg={self.agent}")

    def link_b(self, up: bool) -> None:
        """Host B's end of the link down (it drops off the network) or up again."""
        _ip("-n", self.ns_b, "link", "set", self.if_b, "up" if up else "down")

    def close(self) -> None:
        for ns in (self.ns_a, self.ns_b):  # the veth pair goes with its namespaces
            _ip("netns", "del", ns, check=False)


def _setns(ns: str) -> None:
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
    finally:
        os.close(fd)


class Relay:
    """127.0.0.1:port (root namespace) -> 127.0.0.1:target_port inside namespace `ns`."""

    def __init__(self, ns: str, target_port: int) -> None:
        self.ns, self.target_port = ns, target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._dials: queue.Queue[tuple[queue.Queue[socket.socket | OSError], float]] = queue.Queue()
        self._closed = False
        threading.Thread(target=self._dialer, daemon=True).start()
        threading.Thread(target=self._accept, daemon=True).start()

    def _dialer(self) -> None:
        _setns(self.ns)  # this thread only: its sockets are made inside the namespace
        while True:
            reply, timeout = self._dials.get()
            try:
                reply.put(socket.create_connection(("127.0.0.1", self.target_port), timeout))
            except OSError as e:
                reply.put(e)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reply: queue.Queue[socket.socket | OSError] = queue.Queue()
        self._dials.put((reply, 5.0))
        up = reply.get()
        if isinstance(up, OSError):
            conn.close()  # nothing listens there (yet): the client sees a closed connection
            return
        up.settimeout(None)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=pump, args=(up, conn), daemon=True)
        t.start()
        pump(conn, up)
        t.join()
        conn.close()
        up.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
