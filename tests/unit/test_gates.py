"""The gate timeline is read by the HTTP thread while the gates write it."""

from __future__ import annotations

import json
import threading

import pytest

from contract.errors import BuildError
from serve.gates import GateFailure, GateLog


def test_reading_the_timeline_while_a_gate_writes_its_evidence_never_fails() -> None:
    log = GateLog()
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:  # what GET /health/ready does, as fast as it can
        while not done.is_set():
            try:
                json.dumps(log.to_list())
                log.table()
            except BaseException as e:
                errors.append(e)
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for name in ("load", "warmup"):
            with log.run(name) as ev:
                for i in range(20_000):  # evidence that grows while being read
                    ev[f"k{i}"] = {"i": i, "nested": [i]}
    finally:
        done.set()
        t.join()
    assert not errors, errors[0]
    assert log.evidence("warmup")["k19999"] == {"i": 19999, "nested": [19999]}
    copy = log.to_list()
    copy[0]["evidence"]["mutated"] = True  # a reader's copy is its own
    assert "mutated" not in log.to_list()[0]["evidence"]


def test_a_refusal_fails_its_gate_with_its_cause_and_remedy() -> None:
    log = GateLog()
    with pytest.raises(GateFailure) as info, log.run("resolve") as ev:
        ev["engine"] = "x"
        raise BuildError("config.json is not listed", "rebuild it")
    assert (info.value.gate, info.value.cause, info.value.remedy) == (
        "resolve", "config.json is not listed", "rebuild it")
    gate = log.to_list()[0]
    assert gate["state"] == "failed" and gate["evidence"] == {"engine": "x"}
    assert gate["reason"] == "config.json is not listed — rebuild it"
    log.amend("resolve", note="later")
    assert log.evidence("resolve") == {"engine": "x", "note": "later"}


class _Runner:
    """What warmup_shapes needs of a ModelRunner: it records the plans it runs."""

    def __init__(self) -> None:
        self.executed: list[object] = []

    def execute(self, plan: object) -> None:
        self.executed.append(plan)

    def apply(self, plan: object) -> None:
        pass


def test_a_stop_signal_ends_warmup_between_two_shapes() -> None:
    from contract.profile import BuildProfile
    from serve.gates import shutdown_requested
    from serve.warmup import Interrupted, warmup_shapes

    profile = BuildProfile(max_batch_size=8, max_num_tokens=64, max_seq_len=128,
                           tokens_per_block=16)
    full = warmup_shapes(_Runner(), profile, 64, lambda plan: None)  # type: ignore[arg-type]
    assert [s["shape"] for s in full] == ["prefill 64 tokens", "decode batch 8",
                                          "decode batch 4", "decode batch 2", "decode batch 1"]
    runner, sent, stop = _Runner(), [], threading.Event()

    def send(plan: object) -> None:
        sent.append(plan)
        if len(sent) == 3:  # SIGTERM while the first decode shape runs
            stop.set()

    with pytest.raises(Interrupted):
        warmup_shapes(runner, profile, 64, send, stop.is_set)  # type: ignore[arg-type]
    assert len(runner.executed) == 2  # the shape running when it came finished; no other
    e = shutdown_requested("warmup")
    assert (e.gate, e.cause) == ("warmup", "shutdown requested before admission")
