"""pipeline.store: staging, atomic commit, stale-directory cleaning and disk-full handling, with
real directories, real flocks and real processes that are killed."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.errors import EXIT_BAD_INPUT, EXIT_FAILURE, BuildError
from contract.manifest import read_manifest
from pipeline.store import EngineStore, clean_stale
from tests.conftest import REPO, subprocess_env
from tests.unit.test_manifest import make_engine

EID = "0123456789abcdef"
PID_NEVER_ALIVE = 2**22 + 1  # above the largest pid_max Linux allows: no process has it

# A process that opens a staging directory the way a build does and waits to be killed.
_STAGE_AND_WAIT = """
import sys, time
from pipeline.store import EngineStore
with EngineStore(sys.argv[1]).staging(sys.argv[2], sys.argv[3]) as tmp:
    (tmp / "rank0.safetensors").write_bytes(b"x" * 4096)
    print(tmp, flush=True)
    time.sleep(300)
"""

# A process that holds an exclusive flock on a directory, as a live build elsewhere would.
_LOCK_AND_WAIT = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(300)
"""


def _spawn(code: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip() if proc.stdout else ""
    assert line, f"helper exited early with {proc.wait()}"
    return proc, line


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)  # reaped: a zombie would still look alive to a pid check


def _staging_dirs(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob(".tmp-*"))


@pytest.fixture
def store(tmp_path: Path) -> EngineStore:
    return EngineStore(tmp_path / "store")


def _stage_engine(tmp: Path) -> None:
    """Fill a staging directory with a complete engine (files and manifest)."""
    scratch = tmp.parent / f"scratch-{tmp.name}"
    make_engine(scratch)
    for p in scratch.iterdir():
        shutil.move(str(p), tmp / p.name)
    scratch.rmdir()


def test_engine_is_visible_only_after_commit(store: EngineStore) -> None:
    with store.staging("tiny", EID) as tmp:
        _stage_engine(tmp)
        assert tmp.parent == store.root / "tiny" and tmp.name.startswith(f".tmp-{EID}-{os.getpid()}-")
        assert store.find("tiny", EID) is None
        assert store.list_engines() == []  # a complete staging directory is still not listed
        with pytest.raises(BuildError, match="staging directory"):
            read_manifest(tmp)
        final = store.commit(tmp, "tiny", EID)
    assert final == store.engine_dir("tiny", EID) and store.find("tiny", EID) == final
    assert [r.path for r in store.list_engines()] == [final]
    assert _staging_dirs(store.root / "tiny") == []
    assert all(p.stat().st_mode & 0o222 == 0 for p in final.rglob("*") if p.is_file())


def test_a_failed_build_leaves_nothing(store: EngineStore) -> None:
    with pytest.raises(RuntimeError, match="converter bug"), store.staging("tiny", EID) as tmp:
        (tmp / "rank0.safetensors").write_bytes(b"x" * 100)
        raise RuntimeError("converter bug")
    assert not tmp.exists() and _staging_dirs(store.root / "tiny") == []
    assert store.list_engines() == []


def test_two_commits_of_one_id_keep_the_first(store: EngineStore) -> None:
    """Two builds of the same engine staged at once: the second rename loses, the first
    engine stays untouched, and the loser's staging directory is removed."""
    with store.staging("tiny", EID) as a, store.staging("tiny", EID) as b:
        assert a != b
        _stage_engine(a)
        _stage_engine(b)
        data = json.loads((b / "manifest.json").read_text())
        data["golden"]["tokens"] = [9, 9]  # tell the two apart
        (b / "manifest.json").write_text(json.dumps(data))
        assert store.commit(a, "tiny", EID) == store.engine_dir("tiny", EID)
        assert store.commit(b, "tiny", EID) == store.engine_dir("tiny", EID)
    final = store.engine_dir("tiny", EID)
    assert read_manifest(final).golden["tokens"] == [3, 4]  # the first one's
    assert sorted(p.name for p in (store.root / "tiny").iterdir()) == [EID]


def test_something_that_is_not_an_engine_in_the_engines_place_is_refused(store: EngineStore) -> None:
    final = store.engine_dir("tiny", EID)
    final.mkdir(parents=True)
    (final / "rank0.safetensors").write_bytes(b"half-copied")
    with pytest.raises(BuildError) as info, store.staging("tiny", EID):
        pytest.fail("staging must refuse before any work")
    assert f"{final} exists but is not a complete engine" in info.value.cause
    assert "remove that directory" in info.value.remedy
    assert info.value.exit_code == EXIT_FAILURE
    assert _staging_dirs(final.parent) == []
    # The same refusal when the directory appears while the build runs (commit's rename).
    shutil.rmtree(final)
    with store.staging("tiny", EID) as tmp:
        _stage_engine(tmp)
        final.mkdir()
        (final / "junk").write_text("x")
        with pytest.raises(BuildError, match="exists but is not a complete engine"):
            store.commit(tmp, "tiny", EID)
    assert _staging_dirs(final.parent) == [] and (final / "junk").is_file()


def test_a_killed_builds_leftover_is_never_listed_and_is_cleaned(store: EngineStore) -> None:
    proc, tmp_name = _spawn(_STAGE_AND_WAIT, str(store.root), "tiny", EID)
    tmp = Path(tmp_name)
    try:
        assert clean_stale(tmp.parent) == []  # its build is alive: kept
        assert tmp.is_dir()
    finally:
        _kill(proc)
    assert tmp.is_dir() and (tmp / "rank0.safetensors").is_file()  # SIGKILL cannot clean up
    assert store.list_engines() == []
    with pytest.raises(BuildError, match="staging directory"):
        read_manifest(tmp)
    with store.staging("tiny", EID) as mine:  # the next build removes it
        assert _staging_dirs(tmp.parent) == [mine]
    assert _staging_dirs(tmp.parent) == []


def test_a_live_build_is_kept_whatever_its_pid_says(store: EngineStore) -> None:
    """A build in another container sharing the store has a pid that is not alive here; its
    flock is what says it is alive."""
    model_dir = store.root / "tiny"
    other = model_dir / f".tmp-{EID}-{PID_NEVER_ALIVE}"
    other.mkdir(parents=True)
    proc, _ = _spawn(_LOCK_AND_WAIT, str(other))
    try:
        assert clean_stale(model_dir) == []
        with store.staging("tiny", EID) as mine:
            assert _staging_dirs(model_dir) == sorted([other, mine])
        assert other.is_dir()
    finally:
        _kill(proc)
    assert clean_stale(model_dir) == [other] and not other.exists()


def test_a_dead_build_is_cleaned_even_when_its_pid_was_reused(store: EngineStore) -> None:
    """A build killed long ago whose pid now belongs to another live process (here: this
    one) holds no lock: its directory is stale."""
    model_dir = store.root / "tiny"
    for pid in (os.getpid(), os.getppid()):
        (model_dir / f".tmp-{EID}-{pid}").mkdir(parents=True)
    (model_dir / f".tmp-{EID}-{PID_NEVER_ALIVE}").mkdir()
    assert sorted(p.name for p in clean_stale(model_dir)) == sorted(
        [f".tmp-{EID}-{os.getpid()}", f".tmp-{EID}-{os.getppid()}", f".tmp-{EID}-{PID_NEVER_ALIVE}"])
    assert _staging_dirs(model_dir) == []


def test_without_flock_the_pid_decides(store: EngineStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a filesystem without flock (some network filesystems) the pid in the name is all
    there is: a dead pid's directory goes, a live one's stays, a name without a pid stays."""
    import pipeline.store as store_mod

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(store_mod.fcntl, "flock", no_flock)
    model_dir = store.root / "tiny"
    dead = [model_dir / f".tmp-{EID}-{PID_NEVER_ALIVE}-12345678",  # all-digit tag
            model_dir / f".tmp-{EID}-{PID_NEVER_ALIVE}"]  # named before the tag
    alive = [model_dir / f".tmp-{EID}-{os.getpid()}-0a1b2c3d", model_dir / ".tmp-unnamed"]
    for d in dead + alive:
        d.mkdir(parents=True)
    assert sorted(clean_stale(model_dir)) == sorted(dead)
    with store.staging("tiny", EID) as tmp:
        assert tmp.is_dir() and _staging_dirs(model_dir) == sorted([*alive, tmp])
    assert _staging_dirs(model_dir) == sorted(alive)


def test_clean_stale_leaves_engines_and_other_files_alone(store: EngineStore) -> None:
    model_dir = store.root / "tiny"
    engine = make_engine(model_dir / EID)
    (model_dir / ".tmp-note").write_text("a file, not a staging directory")
    (model_dir / "notes").mkdir()
    os.symlink(engine, model_dir / f".tmp-{EID}-{PID_NEVER_ALIVE}")
    assert clean_stale(model_dir) == []
    assert read_manifest(engine).engine_id == EID
    assert (model_dir / ".tmp-note").is_file() and (model_dir / "notes").is_dir()
    assert clean_stale(store.root / "no-such-model") == []


def test_disk_full_while_writing_is_one_error_and_leaves_nothing(
    store: EngineStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-process fallback of the tmpfs tests below: a writer fails with ENOSPC, wrapped
    the way safetensors wraps it."""
    with pytest.raises(BuildError) as info, store.staging("tiny", EID, need_bytes=1000) as tmp:
        (tmp / "rank0.safetensors").write_bytes(b"x" * 5000)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("Error while serializing: IoError") from e
    err = info.value
    assert err.exit_code == EXIT_FAILURE
    assert err.cause.startswith(f"disk full while writing the engine to {store.root}: it needs "
                                "about 4.9 KiB")
    assert "nothing was left behind" in err.remedy
    assert not tmp.exists() and _staging_dirs(store.root / "tiny") == []


def test_not_enough_space_is_refused_before_staging(store: EngineStore) -> None:
    with pytest.raises(BuildError) as info, store.staging("tiny", EID, need_bytes=1 << 60):
        pytest.fail("staging must refuse before any work")
    assert info.value.exit_code == EXIT_FAILURE
    assert info.value.cause.startswith(f"not enough disk space in {store.root}: the engine needs")
    assert info.value.cause.endswith(" is free")
    assert _staging_dirs(store.root / "tiny") == []


def test_a_store_that_is_a_file_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "store").write_text("not a directory")
    with pytest.raises(BuildError) as info, EngineStore(tmp_path / "store").staging("tiny", EID):
        pytest.fail("unreachable")
    assert info.value.exit_code == EXIT_BAD_INPUT and "is not writable" in info.value.cause


# --- a real full disk: a small tmpfs (needs root, or a mount namespace that allows it) ---


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[callable]:
    mounted: list[Path] = []

    def mount(size: str, nr_inodes: int | None = None) -> Path:
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        opts = f"size={size}" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); "
                        "test_disk_full_while_writing_is_one_error_and_leaves_nothing covers ENOSPC")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_inodes_exhausted_is_disk_full_not_unwritable(tmpfs: callable) -> None:
    """mkdir failing with ENOSPC means a full disk (exit 1), not a store without write
    permission (exit 2)."""
    disk = tmpfs("64m", nr_inodes=3)
    store = EngineStore(disk / "store")
    (disk / "store").mkdir()
    with pytest.raises(BuildError) as info, store.staging("tiny", EID):
        pytest.fail("unreachable")
    err = info.value
    assert err.exit_code == EXIT_FAILURE, str(err)
    assert err.cause.startswith("disk full: cannot create"), str(err)
    assert list((disk / "store").rglob(".tmp-*")) == []


def test_real_enospc_on_a_full_tmpfs(tmpfs: callable) -> None:
    disk = tmpfs("1m")
    store = EngineStore(disk / "store")
    with pytest.raises(BuildError) as info, store.staging("tiny", EID) as tmp:
        (tmp / "rank0.safetensors").write_bytes(b"x" * (2 << 20))  # the kernel says ENOSPC
    assert info.value.exit_code == EXIT_FAILURE
    assert info.value.cause.startswith("disk full while writing the engine")
    assert _staging_dirs(store.root / "tiny") == [] and store.list_engines() == []
    assert shutil.disk_usage(disk).used < (64 << 10)  # the partial file went with its directory


def test_flock_is_what_the_store_relies_on(tmp_path: Path) -> None:
    """The kernel drops a flock when its holder dies, SIGKILL included: the premise of
    clean_stale, checked on this filesystem."""
    d = tmp_path / "d"
    d.mkdir()
    proc, _ = _spawn(_LOCK_AND_WAIT, str(d))
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _kill(proc)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
