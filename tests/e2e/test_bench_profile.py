"""bench/profile.py on a real engine at TP=2 under mpirun: the step profile it reports is whole
(every host-side stage timed, the step function included, the components measured)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import run_mpirun


def test_profile_reports_every_stage_of_a_step(engine_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    proc = run_mpirun(2, [sys.executable, "-m", "bench.profile", "--engine", str(engine_dir),
                          "--batches", "1", "2", "--context", "8", "--steps", "3",
                          "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tp"] == 2 and set(report["batches"]) == {"1", "2"}
    for batch in report["batches"].values():
        eng = batch["engine"]
        assert eng["steps"] >= 2 and eng["tok_s"] > 0
        for stage in ("schedule ms", "prepare inputs ms", "step function ms", "sample ms"):
            assert eng[stage] > 0, (stage, eng)
        assert eng["step function ms"] < eng["ms_per_step"]
