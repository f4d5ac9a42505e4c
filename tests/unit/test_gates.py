"""The gate timeline is read by the HTTP thread while the gates write it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

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


class _TwoHostComm:
    """Rank 0's view of a two-host job: rank 1 on node-b reports `their` gate outcome."""

    rank, size = 0, 2

    def __init__(self, their: list[object]) -> None:
        self.their, self.ended = their, False
        self.peer_watch = self  # the job's end is announced to the peer watch

    def allgather(self, obj: object) -> list[object]:
        return [json.loads(json.dumps(obj)), self.their]

    def expect_end(self) -> None:
        self.ended = True

    def host_label(self, rank: int) -> str:
        return ("node-a", "node-b (10.0.0.2)")[rank]


def _gate_on_two_hosts(their: list[object], torch_here: str = "2.13.0") -> GateLog:
    from serve.launch import LaunchConfig
    from serve.stages import GateContext
    from serve.startup import HOST_FACTS, Startup

    comm = _TwoHostComm(their)
    st = Startup(GateContext(LaunchConfig(engine=Path("/nonexistent")), comm, GateLog()))  # type: ignore[arg-type]
    st.gate("compatible", lambda ev: ev.update({HOST_FACTS: {"torch": torch_here, "files": 3}}))
    return st.log


def test_each_hosts_facts_are_recorded_and_a_failure_names_the_host() -> None:
    log = _gate_on_two_hosts([None, {"torch": "2.13.0", "files": 3}])
    hosts = log.evidence("compatible")["hosts"]
    assert [(h["rank"], h["host"], h["torch"]) for h in hosts] == [
        (0, "node-a", "2.13.0"), (1, "node-b (10.0.0.2)", "2.13.0")]
    with pytest.raises(GateFailure) as e:
        _gate_on_two_hosts([["rank1.safetensors missing", "copy the engine"], None])
    assert str(e.value.cause) == "rank 1 on node-b (10.0.0.2): rank1.safetensors missing"


def test_hosts_with_different_torch_versions_fail_the_gate_naming_them() -> None:
    with pytest.raises(GateFailure) as e:
        _gate_on_two_hosts([None, {"torch": "2.12.1", "files": 3}])
    assert e.value.cause == ("the hosts run different torch versions: 2.13.0 on rank 0 on "
                             "node-a; 2.12.1 on rank 1 on node-b (10.0.0.2)")


def test_a_gate_chain_is_the_gates_in_order_each_taking_the_previous_result() -> None:
    from serve.gates import GateChain, GateStep

    start: GateChain[None] = GateChain()
    chain = (start.then("load", lambda _, ev: 3)
             .then("verify", lambda n, ev: [n] * n)
             .then("kernels", lambda xs, ev: sum(xs)))
    assert [s.name for s in chain.steps] == ["load", "verify", "kernels"]
    value: object = None
    for step in chain.steps:
        value = step.body(value, {})
    assert value == 9
    with pytest.raises(ValueError, match="out of order"):
        start.then("kernels", lambda _, ev: None).then("load", lambda _, ev: None)
    with pytest.raises(ValueError, match="out of order"):
        start.then("load", lambda _, ev: None).then("load", lambda _, ev: None)
    with pytest.raises(ValueError, match="not a start-up gate"):
        GateStep("admission", lambda _, ev: None)  # rank 0's alone, after the chain
