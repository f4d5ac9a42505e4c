"""`serve launch` on its own starts the mpirun it is given (--mpirun, AOTLLM_MPIRUN) and tells
the ranks which one it was, so that the compatible gate can name it."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from serve.launch import parse
from serve.launcher import launch

RECORDER = """#!/bin/sh
python3 -c 'import json, os, sys; json.dump({"argv": sys.argv[1:], "env": os.environ.get("AOTLLM_MPIRUN")}, open(sys.argv[1], "w"))' "$OUT" "$@"
"""


def test_launcher_starts_the_mpirun_it_is_given(engine_tp1: Path, tmp_path: Path) -> None:
    fake = tmp_path / "ompi4" / "bin" / "mpirun"
    fake.parent.mkdir(parents=True)
    fake.write_text(RECORDER.replace('"$OUT" "$@"', f'{tmp_path / "ran.json"} "$@"'))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    argv = ["--engine", str(engine_tp1), "--mpirun", str(fake)]
    assert launch(argv, parse(argv)) == 0
    ran = json.loads((tmp_path / "ran.json").read_text())
    assert ran["env"] == str(fake)  # the ranks know which mpirun started them
    assert ran["argv"][ran["argv"].index("-n") + 1] == "1"  # TP from the manifest
    assert ran["argv"][-len(argv) - 2:] == ["serve", "launch", *argv]


def test_launcher_refuses_an_mpirun_that_is_not_there(
        engine_tp1: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine", str(engine_tp1), "--mpirun", str(tmp_path / "nope" / "mpirun")]
    assert launch(argv, parse(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: mpirun ") and "nope/mpirun" in err and "Traceback" not in err
