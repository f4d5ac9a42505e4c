"""The control plane: only this job's ranks get in, and frames are data, never code."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
from pathlib import Path

import pytest

from runtime.core.plan import NewSeq, ScheduledSeq, StepPlan
from runtime.dist import bootstrap as comm_mod
from runtime.dist.comm import Bootstrap, Comm
from runtime.dist.wire import plan_from_wire, plan_to_wire

SECRET = "ab" * 32


def _boot(rank: int, port: int, secret: str = SECRET) -> Bootstrap:
    return Bootstrap(rank, 2, rank, 2, "", "127.0.0.1", port, secret)


def _leader() -> tuple[socket.socket, dict[str, object], threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["comm"] = Comm(_boot(0, listener.getsockname()[1]), listener, connect_timeout_s=20)
        except Exception as e:  # reported to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return listener, out, t


class _Exploit:
    """Unpickling this creates a file: proof that a pickle frame would run code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, int]]:
        return (os.open, (self.path, os.O_CREAT | os.O_WRONLY))


def test_stranger_with_a_crafted_payload_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    listener, out, t = _leader()
    port = listener.getsockname()[1]
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(str(marker)))
    with socket.create_connection(("127.0.0.1", port)) as stranger:
        stranger.recv(comm_mod.NONCE)  # the challenge
        # A peer's handshake shape with a made-up proof, then a pickle "plan".
        stranger.sendall((1).to_bytes(4, "little") + b"n" * 32 + b"p" * 32)
        stranger.sendall(len(payload).to_bytes(8, "little") + payload)
        stranger.settimeout(5)
        with contextlib.suppress(ConnectionResetError):  # a reset: our frame was never read
            assert stranger.recv(64) == b""  # closed on us
    # The real rank 1 still gets in, and the job works.
    peer = Comm(_boot(1, port), connect_timeout_s=20)
    t.join(20)
    leader = out["comm"]
    assert isinstance(leader, Comm)
    results: list[object] = []
    reader = threading.Thread(target=lambda: results.append(peer.allgather({"rank": 1})))
    reader.start()
    assert leader.allgather({"rank": 0}) == [{"rank": 0}, {"rank": 1}]
    reader.join(10)
    assert results == [[{"rank": 0}, {"rank": 1}]]
    plan = StepPlan(3, new_seqs=[NewSeq(7, [1, 2, 3])], appended_tokens={5: 9},
                    scheduled=[ScheduledSeq(7, 0, 3, [1], True)], freed_seq_ids=[2])
    leader.send_plan(plan)
    assert peer.recv_plan() == plan
    assert not marker.exists()
    leader.close()
    peer.close()


def test_a_peer_with_the_wrong_secret_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    listener, out, t = _leader()
    port = listener.getsockname()[1]
    with pytest.raises(ConnectionError):
        Comm(_boot(1, port, secret="cd" * 32), connect_timeout_s=5)
    peer = Comm(_boot(1, port), connect_timeout_s=20)  # the right one afterwards
    t.join(20)
    assert isinstance(out.get("comm"), Comm)
    peer.close()
    out["comm"].close()  # type: ignore[union-attr]


def test_a_silent_stranger_cannot_stall_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm_mod, "HANDSHAKE_TIMEOUT_S", 0.5)
    listener, out, t = _leader()
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)):
        peer = Comm(_boot(1, port), connect_timeout_s=20)  # waits behind the stranger
        t.join(20)
    assert isinstance(out.get("comm"), Comm), out
    peer.close()
    out["comm"].close()  # type: ignore[union-attr]


def test_a_bootstrap_without_a_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="secret"):
        Comm(_boot(1, 1, secret=""))


def test_plans_round_trip_through_the_wire() -> None:
    plan = StepPlan(11, new_seqs=[NewSeq(-1, [5] * 40), NewSeq(4, [1])],
                    appended_tokens={1: 2, 3: 4},
                    scheduled=[ScheduledSeq(-1, 16, 24, [3, 4], False), ScheduledSeq(4, 0, 1, [], True)],
                    freed_seq_ids=[9, 10], shutdown=True)
    assert plan_from_wire(plan_to_wire(plan)) == plan
