"""Only files the manifest lists are read, each checked once, and loaders read the copy."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from contract.errors import BuildError
from contract.manifest import FileEntry, Manifest, Source
from contract.profile import BuildProfile
from contract.target import Target
from runtime.store.files import EngineFiles, close_all


def _engine(tmp_path: Path, files: dict[str, bytes], listed: tuple[str, ...]) -> tuple[Path, Manifest]:
    root = tmp_path / "engine"
    root.mkdir()
    entries = []
    for name, data in files.items():
        (root / name).write_bytes(data)
        if name in listed:
            entries.append(FileEntry(name, None, len(data), hashlib.sha256(data).hexdigest()))
    m = Manifest("0" * 16, "m", Source("x", None, "d"), "aoti", Target("cpu", "x86_64", "avx2"),
                 1, "float32", BuildProfile(), {}, tuple(entries))
    return root, m


def test_an_unlisted_file_is_refused_by_name(tmp_path: Path) -> None:
    root, m = _engine(tmp_path, {"config.json": b"{}", "rank0.pt2": b"\x7fELF..."},
                      listed=("config.json",))
    files = EngineFiles(root, m)
    try:
        with pytest.raises(BuildError, match=r"rank0\.pt2 is not listed in the engine's manifest"):
            files.get("rank0.pt2")
        with pytest.raises(BuildError, match=r"rank0\.pt2 is not listed"):
            files.require("rank0.pt2")
        assert files.get("config.json").read_bytes() == b"{}"
    finally:
        files.close()


def test_a_modified_file_is_refused_and_never_copied(tmp_path: Path) -> None:
    root, m = _engine(tmp_path, {"tokenizer.json": b'{"v": 1}'}, listed=("tokenizer.json",))
    (root / "tokenizer.json").write_bytes(b'{"v": 2}')  # same size, other bytes
    files = EngineFiles(root, m)
    try:
        with pytest.raises(BuildError, match="does not match the manifest's sha256"):
            files.get("tokenizer.json")
        assert not (files.dir / "tokenizer.json").exists()
        with pytest.raises(BuildError, match="does not match"):
            files.check("tokenizer.json", hashlib.sha256(b'{"v": 2}').hexdigest())
    finally:
        files.close()


def test_loaders_read_the_verified_copy_not_the_engine_directory(tmp_path: Path) -> None:
    root, m = _engine(tmp_path, {"rank0.pt2": b"verified bytes"}, listed=("rank0.pt2",))
    files = EngineFiles(root, m)
    copy = files.get("rank0.pt2")
    (root / "rank0.pt2").write_bytes(b"swapped after the check")  # a race we must not lose
    assert copy.read_bytes() == b"verified bytes" and files.get("rank0.pt2") == copy
    assert copy.parent == files.dir and oct(files.dir.stat().st_mode & 0o777) == "0o700"
    assert files.get_listed(("rank0.pt2", "tokenizer.json")) == [copy]  # unlisted: skipped
    close_all()
    assert not files.dir.exists()


_HOLDER = """
import sys, time
from pathlib import Path
from tests.unit.test_engine_files import _engine
from runtime.store.files import EngineFiles
root, m = _engine(Path(sys.argv[1]), {"config.json": b"{}"}, listed=("config.json",))
files = EngineFiles(root, m)
files.get("config.json")
print(files.dir, flush=True)
time.sleep(600)
"""


def _holder(tmp: Path, name: str) -> tuple[subprocess.Popen[str], Path]:
    (tmp / name).mkdir()
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp / name)], text=True,
                         stdout=subprocess.PIPE, cwd=Path(__file__).parents[2],
                         env={**os.environ, "TMPDIR": str(tmp)})
    assert p.stdout is not None
    return p, Path(p.stdout.readline().strip())


def test_a_killed_process_leaves_no_copy_behind(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed outright (SIGKILL) cannot clean up; the next one removes its copy,
    and never the copy of a process that is alive."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, killed_dir = _holder(tmp_path, "a")
    alive, alive_dir = _holder(tmp_path, "b")
    try:
        assert (killed_dir / "config.json").exists() and killed_dir.parent == tmp_path
        killed.kill()
        killed.wait()
        assert killed_dir.exists()  # nobody could remove it yet
        (tmp_path / "c").mkdir()
        root, m = _engine(tmp_path / "c", {"config.json": b"{}"}, listed=("config.json",))
        files = EngineFiles(root, m)
        assert not killed_dir.exists()
        assert (alive_dir / "config.json").exists()  # its owner holds the lock
        files.close()
        assert not files.dir.exists() and alive_dir.exists()
    finally:
        alive.kill()
        alive.wait()
        killed.wait()
