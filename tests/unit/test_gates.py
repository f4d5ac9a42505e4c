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
