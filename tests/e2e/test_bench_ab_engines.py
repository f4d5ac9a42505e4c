"""bench/ab_engines.py on two real TP=1 engines of one model (float32 and int4_wo): both are
measured in every round, at every batch and prompt length asked for, and a TP=2 engine is
refused with one line, not a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env
from tests.e2e.test_serve_spec_draft import DRAFT_ARGS, TARGET_ARGS, build


def run_ab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.ab_engines", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def two_engines(served_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    store = tmp_path_factory.mktemp("ab-store")
    out = []
    for args in (TARGET_ARGS, DRAFT_ARGS):
        proc = build(served_checkpoint, store, *args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out.append(Path(proc.stdout.strip().splitlines()[-1]))
    assert out[0] != out[1]
    return out


def test_both_engines_are_measured_in_every_round(two_engines: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    proc = run_ab("--engines", *map(str, two_engines), "--batches", "1", "2", "--prompts", "8",
                  "--steps", "3", "--context", "8", "--rounds", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["engines"] == [str(p) for p in two_engines]
    assert set(report["series"]) == {"decode b1 ms", "decode b2 ms", "prompt 8 ms"}
    for name, sides in report["series"].items():
        assert set(sides) == {"A", "B"}, name
        for values in sides.values():
            assert len(values) == 2 and all(v > 0 for v in values), (name, sides)
    assert "| decode b1 ms |" in proc.stdout


def test_a_tp2_engine_is_refused_in_one_line(two_engines: list[Path], engine_dir: Path) -> None:
    proc = run_ab("--engines", str(two_engines[0]), str(engine_dir), "--rounds", "1")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{engine_dir} is a TP=2 engine" in proc.stderr
