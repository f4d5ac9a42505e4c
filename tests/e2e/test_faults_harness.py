"""`make faults` (bench/faults.py) on real TP=2 jobs: each fault lands in the gate it names,
and the harness's verdict is right on both sides of the load gate.

The tiny engine's gates pass in milliseconds, which is exactly where faults fired on a
timer used to miss their gate (issue 38): the ranks are held inside the named gate
(AOTLLM_INJECT_GATE_HOLD) until the fault is in.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import faults


def test_faults_land_in_their_gate_and_are_judged_by_its_side(engine_dir: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "faults"
    rc = faults.main(["--engine", str(engine_dir), "--out", str(out), "--only",
                      "rm-engine-load", "rm-engine-connect", "load-kill1"])
    rows = {r["name"]: r for r in json.loads((out / "summary.json").read_text())}
    summary = (out / "summary.md").read_text()
    assert rc == 0, summary

    # Before the load gate has the shards: the job ends, naming the file it cannot read.
    before = rows["rm-engine-load"]
    assert (before["gate"], before["hit"], before["expect"]) == ("load", "load", "end")
    assert before["seconds"] is not None and before["seconds"] < 10, before
    assert before["exit_code"] != 0
    assert "gate load failed: cannot read rank" in before["cause"], before["cause"]
    assert ".safetensors" in before["cause"], before["cause"]

    # After it (connect): every file was read and verified; the server serves from memory
    # and drains cleanly on SIGTERM.
    after = rows["rm-engine-connect"]
    assert (after["gate"], after["hit"], after["expect"]) == ("connect", "connect", "serve")
    assert after["clients_ok"] and after["exit_code"] == 0, after
    assert "complete(200) x4" in after["clients"] and "chat 200" in after["clients"], after
    assert all(code == 0 for code in after["rank_exits"].values()), after

    # A peer killed inside the load gate ends the job, the dead rank named.
    kill = rows["load-kill1"]
    assert kill["hit"] == "load" and kill["cause_named"], kill
    assert "rank 1" in kill["cause"], kill["cause"]

    # The summary shows where each fault landed.
    assert "| rm-engine-load | load |" in summary and "| rm-engine-connect | connect |" in summary
