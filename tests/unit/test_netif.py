"""runtime/dist/netif.py: which of rank 0's addresses the ranks listen on and try, and how an
explicit choice (--comm-iface, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) is read."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.dist.netif import (
    Iface,
    InterfaceError,
    asked_ifaces,
    interfaces,
    listen_candidates,
    order_for_peer,
    requested,
)
from tests.conftest import REPO, subprocess_env

LO = Iface("lo", "127.0.0.1", 8, True)
ETH = Iface("eth0", "10.1.0.5", 24, False)
IB = Iface("ib0", "192.168.7.5", 24, False)
DOCKER = Iface("docker0", "172.17.0.1", 16, False)
HOST = [LO, ETH, IB, DOCKER]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)


def test_one_host_listens_on_loopback_only() -> None:
    assert listen_candidates(None, one_host=True, ifaces=HOST) == [Iface("lo", "127.0.0.1", 8, True)]


def test_several_hosts_listen_on_every_interface_but_loopback_and_container_bridges() -> None:
    assert listen_candidates(None, one_host=False, ifaces=HOST) == [ETH, IB]


def test_explicit_choice_wins_flag_over_gloo_over_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth")
    assert requested(None) == ("eth", "NCCL_SOCKET_IFNAME")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert requested(None) == ("ib0", "GLOO_SOCKET_IFNAME")
    assert requested("eth0") == ("eth0", "--comm-iface")
    # The choice applies on one host too (the ranks bind what they were told).
    assert listen_candidates(None, one_host=True, ifaces=HOST) == [IB]


def test_names_match_exactly_else_as_a_prefix_and_a_caret_excludes() -> None:
    assert asked_ifaces("eth0", HOST) == [ETH]
    assert asked_ifaces("eth", HOST) == [ETH]  # NCCL's prefix rule
    assert asked_ifaces("=ib0", HOST) == [IB]
    assert asked_ifaces("^docker,lo", HOST) == [ETH, IB]
    assert asked_ifaces(None, HOST) is None


def test_an_interface_this_host_lacks_is_an_error_naming_the_host_and_what_it_has() -> None:
    with pytest.raises(InterfaceError) as e:
        asked_ifaces("nosuch0", HOST)
    msg = str(e.value)
    assert "nosuch0" in msg and "--comm-iface" in msg and "eth0 10.1.0.5/24" in msg


def test_a_peer_tries_a_shared_subnet_first_and_never_its_own_address() -> None:
    leader = [("172.17.0.1", 1), ("192.168.7.1", 2), ("10.1.0.1", 3), ("127.0.0.1", 4)]
    mine = [LO, ETH, DOCKER]  # the same docker bridge address as rank 0's: not rank 0
    order = order_for_peer(leader, mine)
    assert order[0] == ("10.1.0.1", 3)  # the subnet both have
    assert ("172.17.0.1", 1) not in order
    assert order[-1] == ("127.0.0.1", 4)  # loopback last, only if nothing else answers


def test_this_machine_has_an_up_loopback() -> None:
    assert any(i.loopback and i.addr.startswith("127.") for i in interfaces())


def test_rank_host_keeps_the_host_up_until_its_ranks_have_drained(tmp_path: Path) -> None:
    """`serve rank-host -- CMD` (a worker pod's PID 1): a SIGTERM goes to the rank processes
    under CMD (here a stand-in whose command line is a rank's), CMD is stopped only once
    they have exited, and rank-host exits 0."""
    marker, ready = tmp_path / "signalled", tmp_path / "ready"
    rank = (f"import signal, sys, time, pathlib\n"
            f"def stop(*_):\n"
            f"    pathlib.Path({str(marker)!r}).write_text(str(time.monotonic()))\n"
            f"    time.sleep(1.5)  # a drain\n"
            f"    sys.exit(0)\n"
            f"signal.signal(signal.SIGTERM, stop)\n"
            f"pathlib.Path({str(ready)!r}).write_text('')\n"
            f"time.sleep(60)\n")
    daemon = f"{shlex.quote(sys.executable)} -c {shlex.quote(rank)} serve launch & sleep 60"
    proc = subprocess.Popen([sys.executable, "-m", "serve", "rank-host", "--drain-timeout", "5",
                             "--", "sh", "-c", daemon], cwd=REPO, env=subprocess_env(),
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():  # the stand-in's handler is set (rank-host's was, before it)
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.stderr.read() if proc.stderr else ""
        took = time.monotonic() - t0
        assert marker.exists(), "the rank got no SIGTERM"
        assert 1.5 <= took < 8, took  # waited for the drain, then stopped sh at once
    finally:
        proc.kill()
