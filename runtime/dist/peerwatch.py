"""Peer failures and stop requests on the control plane's connections (a part of Comm).

A dead peer closes its socket: rank 0 sees EOF on a worker's connection and a worker on
rank 0's. A host that drops off the network closes nothing: TCP keepalive probes and a user
timeout on every control connection (runtime/dist/bootstrap.py) turn its silence into an error
within PEER_TIMEOUT_S. `watch` (a thread on every rank, from the connection on) reports
either, naming the rank and its host; after admission it also reads the one frame a rank
> 0 may send rank 0, a request to drain the job (its host is stopping).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Callable

from runtime.dist.bootstrap import SILENT, describe_failure
from runtime.dist.wire import dumps, loads, recv_frame, send_frame

DRAIN_REQUEST = {"drain": True}  # a rank > 0 asks rank 0 to drain the job (after admission)
_FAIL_MASK = select.POLLERR | select.POLLHUP | select.POLLRDHUP | select.POLLNVAL


class PeerWatch:
    """The failure watch of one rank's control connections. Comm owns one (`comm.peer_watch`)
    and hands it the sockets once they are connected; `who` names a rank with its host."""

    def __init__(self, rank: int, size: int, who: Callable[[int], str]) -> None:
        self.rank, self.size, self._who = rank, size, who
        self._peers: list[socket.socket] = []  # rank 0: index r-1 is rank r
        self._leader: socket.socket | None = None  # ranks > 0
        self._ending = threading.Event()  # the job ends by agreement: disconnects expected
        self._reading = False  # rank 0 after admission: peers may send drain requests
        self._wake: tuple[int, int] | None = None

    def connected(self, peers: list[socket.socket], leader: socket.socket | None) -> None:
        """The control connections to watch, once the bootstrap has made them."""
        self._peers, self._leader = list(peers), leader

    @property
    def ending(self) -> bool:
        return self._ending.is_set()

    def expect_end(self) -> None:
        """The job is ending by agreement (a gate failed everywhere, the drain is over):
        peers leaving from now on are not failures."""
        self._ending.set()
        self._poke()

    def request_drain(self) -> None:
        """Rank > 0 after admission: ask rank 0 to drain the job (this host is stopping)."""
        if self._leader is not None and not self._ending.is_set():
            with contextlib.suppress(OSError):
                send_frame(self._leader, dumps(DRAIN_REQUEST))

    def accept_drain_requests(self) -> None:
        """Rank 0 after admission (no frame comes from a peer any more but a drain request):
        `watch` reads them from now on."""
        self._reading = True
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"x")

    def lost_peer(self, wait_s: float) -> str | None:
        """The first peer whose control connection has failed, within `wait_s`, named with
        its host; None when every peer is still connected. A collective that fails (gloo's
        "connection reset") names only an address; a dead peer's control socket has its
        hang-up by then or a moment later."""
        socks = list(enumerate(self._peers, start=1)) if self.rank == 0 else (
            [(0, self._leader)] if self._leader is not None else [])
        if not socks:
            return None
        poller = select.poll()
        for _, s in socks:
            poller.register(s.fileno(), _FAIL_MASK)
        by_fd = {s.fileno(): (r, s) for r, s in socks}
        for fd, _ in poller.poll(max(0, int(wait_s * 1000))):
            rank, sock = by_fd[fd]
            return f"{self._who(rank)}: {describe_failure(None, sock)}"
        return None

    def watch(self, on_failure: Callable[[str], None],
              on_drain_request: Callable[[int], None] | None = None) -> None:
        """A thread that reports the first peer connection to fail (the peer died, closed,
        or its host stopped answering for PEER_TIMEOUT_S), naming the rank and its host;
        from the start, so a rank stuck in a gate or a collective learns it too. Nothing is
        read from the sockets until `accept_drain_requests` (the main thread reads them)."""
        if self.size == 1:
            return
        socks = ({p.fileno(): (r, p) for r, p in enumerate(self._peers, start=1)}
                 if self.rank == 0 else {self._leader.fileno(): (0, self._leader)}  # type: ignore[union-attr]
                 )
        self._wake = os.pipe()

        def register(poller: select.poll) -> None:
            mask = _FAIL_MASK | (select.POLLIN if self._reading else 0)
            for fd in socks:
                poller.register(fd, mask)

        def run() -> None:
            poller = select.poll()
            assert self._wake is not None
            poller.register(self._wake[0], select.POLLIN)
            register(poller)
            while True:
                for fd, ev in poller.poll():
                    if self._ending.is_set():
                        return
                    if fd == self._wake[0]:
                        os.read(fd, 64)
                        register(poller)  # modify: the reading mode may have changed
                        continue
                    rank, sock = socks[fd]
                    why = None
                    if ev & _FAIL_MASK:
                        why = describe_failure(None, sock)
                    elif self._reading:
                        try:
                            msg = loads(recv_frame(sock))
                        except (OSError, ConnectionError, ValueError) as e:
                            why = describe_failure(e, sock)
                        else:
                            if msg == DRAIN_REQUEST and on_drain_request is not None:
                                on_drain_request(rank)
                            continue
                    if why is None:
                        continue
                    # A clean end races its own disconnects: give it a moment to be seen. A
                    # silent host is no clean end, and its time is already spent.
                    if not why.startswith(SILENT) and self._ending.wait(1.0):
                        return
                    on_failure(f"{self._who(rank)}: {why}")
                    return

        threading.Thread(target=run, name="peer-watch", daemon=True).start()
