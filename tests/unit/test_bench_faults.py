"""The fault harness's verdict (bench/faults.py), on both sides of the load gate (no server).

The harness runs against real jobs (tests/e2e/test_faults_harness.py); here each verdict
is fed the outcomes it must accept and the ones it must flag, so a harness that judges a
correct server wrong, or a wrong server right, fails.
"""

from __future__ import annotations

import pytest

from bench.faults import Row, expect_after_rm
from serve.startup import GATES

LIMIT = 10.0


def ended(gate: str, **kw: object) -> Row:
    """A job that ended 0.8 s after a fault inside `gate`, its cause named."""
    row = Row(f"rm-engine-{gate}", "rm", gate=gate, expect="end", hit=gate, seconds=0.8,
              exit_code=1, cause="gate load failed: cannot read rank1.safetensors",
              cause_named=True)
    for k, v in kw.items():
        setattr(row, k, v)
    return row


def served(gate: str, **kw: object) -> Row:
    """A job that served every request after the fault, then drained with exit 0."""
    row = Row(f"rm-engine-{gate}", "rm", gate=gate, expect="serve", hit=gate, seconds=1.2,
              exit_code=0, cause="drained", cause_named=True, clients="complete(200) x4")
    for k, v in kw.items():
        setattr(row, k, v)
    return row


@pytest.mark.parametrize("gate", GATES)
def test_the_side_of_the_engine_reads(gate: str) -> None:
    """Up to the load gate the shards are not in memory: the job must end. An aoti engine
    still reads its package at verify; nothing is read from connect on."""
    before_load = GATES.index(gate) <= GATES.index("load")
    assert expect_after_rm(gate, "eager") == ("end" if before_load else "serve")
    through_verify = GATES.index(gate) <= GATES.index("verify")
    assert expect_after_rm(gate, "aoti") == ("end" if through_verify else "serve")


def test_before_the_load_gate_a_named_end_passes() -> None:
    assert ended("load").findings(LIMIT) == []


def test_before_the_load_gate_the_harness_flags_what_is_wrong() -> None:
    assert ended("load", seconds=None).findings(LIMIT) == [
        "HANG: the job did not end (killed by the harness)"]
    assert ended("load", seconds=14.0).findings(LIMIT) == ["slow: 14.0 s > 10 s"]
    assert ended("load", cause_named=False).findings(LIMIT) == ["cause not named"]
    # The fault landed in another gate than the scenario's name says (the old timing bug).
    assert ended("load", hit="warmup").findings(LIMIT) == ["landed in warmup, not in load"]
    assert ended("load", hit="").findings(LIMIT) == ["landed in no gate, not in load"]


def test_after_the_load_gate_serving_on_passes() -> None:
    assert served("connect").findings(LIMIT) == []
    # Once ready there is no gate: such a scenario names none and is judged on serving.
    assert served("", hit="after admission").findings(LIMIT) == []


def test_after_the_load_gate_the_harness_flags_what_is_wrong() -> None:
    # The server stopped although everything was in memory: it should have served on.
    stopped = served("connect", exit_code=1, clients_ok=False,
                     clients="never ready: the server exited (1) before ready")
    assert stopped.findings(LIMIT) == [
        "clients: never ready: the server exited (1) before ready",
        "should have kept serving and drained; exited 1"]
    assert served("connect", seconds=None).findings(LIMIT) == [
        "HANG: the job did not end (killed by the harness)"]
    assert served("connect", exit_code=3).findings(LIMIT) == [
        "should have kept serving and drained; exited 3"]
    assert served("connect", hit="load").findings(LIMIT) == ["landed in load, not in connect"]
