"""The engine store: <store>/<model-name>/<engine-id>/, written atomically.

A build writes into <store>/<model-name>/.tmp-<engine-id>-<pid>-<tag>/ and renames it into
place only when every file and the manifest are written and synced, so a reader sees either no
engine or a complete one (and `read_manifest` refuses a .tmp-* directory outright).

Each staging directory is held under an exclusive flock for as long as its build runs. The
kernel drops the lock when the process ends, however it ends (SIGKILL included), so a
.tmp-* directory whose lock is free belongs to a build that is gone: the next build in that
directory removes it. Cleaning and creating staging directories happen under a flock on
their parent, so a cleaner never sees a new directory before its owner has locked it. A lock
says more than a pid: pids are reused, and a build in another container (another pid
namespace) sharing the store has a pid that means nothing here. On a filesystem without
flock the pid in the name is the fallback.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from contract.errors import EXIT_FAILURE, BuildError
from contract.layout import MANIFEST_NAME
from contract.manifest import STAGING_PREFIX, Manifest, read_manifest
from pipeline.progress import format_bytes

_TAG_HEX = 8
# .tmp-<name>-<pid>-<tag>, and .tmp-<engine-id>-<pid> as builds before the tag named them.
_STAGING = (
    re.compile(rf"^{re.escape(STAGING_PREFIX)}(?P<name>.+)-(?P<pid>\d+)-[0-9a-f]{{{_TAG_HEX}}}$"),
    re.compile(rf"^{re.escape(STAGING_PREFIX)}(?P<name>[0-9a-f]+)-(?P<pid>\d+)$"),
)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, slots=True)
class EngineRecord:
    path: Path
    manifest: Manifest | None  # None when the manifest cannot be read
    error: str | None = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def is_disk_full(exc: BaseException) -> bool:
    """Writers wrap ENOSPC in their own errors (safetensors, the C++ compiler); walk the chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _try_lock(fd: int, blocking: bool = False) -> bool | None:
    """Take an exclusive flock: True if taken, False if another process holds it, None where
    the filesystem has no flock (some network filesystems)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        return None
    return True


@contextmanager
def _locked(parent: Path) -> Iterator[None]:
    """Hold an exclusive flock on the directory ``parent`` (best effort: a filesystem without
    flock, or a directory we cannot open, runs unlocked as before)."""
    try:
        fd = _open_dir(parent)
    except OSError:
        yield
        return
    try:
        _try_lock(fd, blocking=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def _clean_stale_locked(parent: Path) -> list[Path]:
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for d in entries:
        if not d.name.startswith(STAGING_PREFIX):
            continue
        try:
            fd = _open_dir(d)
        except OSError:  # gone (committed or cleaned meanwhile), a file, or a link: not ours
            continue
        try:
            free = _try_lock(fd)
            if free is None:  # no flock here: fall back to the pid in the name
                m = next((m for r in _STAGING if (m := r.match(d.name))), None)
                free = m is not None and not _pid_alive(int(m["pid"]))
            if free:
                shutil.rmtree(d, ignore_errors=True)
                if not d.exists():
                    removed.append(d)
        finally:
            os.close(fd)
    return removed


def clean_stale(parent: Path) -> list[Path]:
    """Remove the .tmp-* directories in ``parent`` whose build is gone; returns them.

    Never raises: a store we may read but not write still serves cache hits."""
    if not parent.is_dir():
        return []
    with _locked(parent):
        return _clean_stale_locked(parent)


@contextmanager
def staging_dir(parent: Path, name: str) -> Iterator[Path]:
    """A fresh, locked ``parent/.tmp-<name>-<pid>-<tag>`` directory, removed on exit unless it
    was renamed away; stale ones left by builds that died are removed first.

    Raises OSError when the directory cannot be created (the caller words the error)."""
    with _locked(parent):
        _clean_stale_locked(parent)
        tmp = parent / f"{STAGING_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(_TAG_HEX // 2)}"
        tmp.mkdir()
        try:
            fd = _open_dir(tmp)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _try_lock(fd)  # nobody else can hold it yet: they all wait for the parent's lock
    try:
        yield tmp
    finally:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            os.close(fd)


class EngineStore:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser()

    def engine_dir(self, model_name: str, engine_id: str) -> Path:
        return self.root / model_name / engine_id

    def find(self, model_name: str, engine_id: str) -> Path | None:
        """The complete engine with this id, or None."""
        d = self.engine_dir(model_name, engine_id)
        return d if (d / MANIFEST_NAME).is_file() else None

    def _not_writable(self, path: Path, e: OSError) -> BuildError:
        if e.errno in _DISK_FULL:
            return BuildError(
                f"disk full: cannot create {path} in the engine store {self.root} "
                f"({e.strerror or e})",
                "free some space (or inodes) or pass --store on a larger disk",
                exit_code=EXIT_FAILURE,
            )
        return BuildError(
            f"engine store {self.root} is not writable ({e.strerror or e} at {path})",
            "pass --store with a directory you can write to",
        )

    def _occupied(self, path: Path) -> BuildError:
        return BuildError(
            f"{path} exists but is not a complete engine (it has no {MANIFEST_NAME})",
            "remove that directory (engines are only ever written by pipeline build) and build again",
            exit_code=EXIT_FAILURE,
        )

    def clean_stale(self, model_name: str) -> list[Path]:
        """Remove the .tmp-* directories of builds that are gone; returns them."""
        return clean_stale(self.root / model_name)

    @contextmanager
    def staging(self, model_name: str, engine_id: str, need_bytes: int = 0) -> Iterator[Path]:
        """A fresh temporary engine directory; removed on exit unless ``commit`` moved it.

        Refuses up front when the disk has less than ``need_bytes`` free or the engine's place
        is taken by something that is not an engine, and turns a disk that fills up anyway
        into a BuildError that says how much was needed.
        """
        model_dir = self.root / model_name
        try:
            model_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._not_writable(model_dir, e) from e
        self.clean_stale(model_name)  # first: a dead build's leftovers count against the free space
        final = self.engine_dir(model_name, engine_id)
        if final.exists() and self.find(model_name, engine_id) is None:
            raise self._occupied(final)
        free = shutil.disk_usage(model_dir).free
        if need_bytes and free < need_bytes:
            raise BuildError(
                f"not enough disk space in {self.root}: the engine needs about "
                f"{format_bytes(need_bytes)} and {format_bytes(free)} is free",
                "free some space or pass --store on a larger disk",
                exit_code=EXIT_FAILURE,
            )
        with ExitStack() as stack:
            try:
                tmp = stack.enter_context(staging_dir(model_dir, engine_id))
            except OSError as e:
                raise self._not_writable(model_dir, e) from e
            try:
                yield tmp
            except BaseException as e:
                written = _dir_size(tmp) if tmp.exists() else 0
                stack.close()  # remove the staging directory before the error is reported
                if isinstance(e, Exception) and is_disk_full(e):
                    need = max(need_bytes, written)
                    raise BuildError(
                        f"disk full while writing the engine to {self.root}: it needs about "
                        f"{format_bytes(need)} and {format_bytes(free)} was free when the "
                        "build began",
                        "free some space or pass --store on a larger disk; nothing was left behind",
                        exit_code=EXIT_FAILURE,
                    ) from e
                raise

    def commit(self, tmp: Path, model_name: str, engine_id: str) -> Path:
        """Make the staged engine visible: sync its bytes, mark files read-only, rename.

        When a concurrent build of the same id got there first, its engine stays (engines
        are immutable) and ours is discarded with the staging directory: the caller should
        read the manifest back from the returned directory."""
        final = self.engine_dir(model_name, engine_id)
        for p in tmp.rglob("*"):
            if p.is_file():
                _fsync(p)
                p.chmod(0o444)  # engines are immutable; this keeps honest tools from editing them
        _fsync(tmp)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                if self.find(model_name, engine_id):
                    return final  # a concurrent build of the same id won; ours is discarded
                raise self._occupied(final) from e
            raise
        _fsync(final.parent)
        return final

    def list_engines(self) -> list[EngineRecord]:
        """Every complete engine in the store; staging directories are never listed."""
        records: list[EngineRecord] = []
        if not self.root.is_dir():
            return records
        for model_dir in sorted(self.root.iterdir()):
            if model_dir.name.startswith(".") or not model_dir.is_dir():
                continue
            for d in sorted(model_dir.iterdir()):
                if d.name.startswith(".") or not (d / MANIFEST_NAME).is_file():
                    continue
                try:
                    records.append(EngineRecord(d, read_manifest(d)))
                except BuildError as e:
                    records.append(EngineRecord(d, None, e.cause))
        return records
