"""The engine store: <store>/<model-name>/<engine-id>/, written atomically.

A build writes into <store>/<model-name>/.tmp-<engine-id>-<pid>/ and renames it into place
only when every file and the manifest are written and synced, so a reader sees either no
engine or a complete one. A build that dies leaves a .tmp-* directory, which no reader looks
at and the next build in that model directory removes once its pid is gone.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from contract.errors import EXIT_FAILURE, BuildError
from contract.layout import MANIFEST_NAME
from contract.manifest import Manifest, read_manifest
from pipeline.progress import format_bytes

_TMP = re.compile(r"^\.tmp-(?P<id>[0-9a-f]+)-(?P<pid>\d+)$")
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


def _is_disk_full(exc: BaseException) -> bool:
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
        return BuildError(
            f"engine store {self.root} is not writable ({e.strerror or e} at {path})",
            "pass --store with a directory you can write to",
        )

    def clean_stale(self, model_name: str) -> list[Path]:
        """Remove the .tmp-* directories of builds whose process is gone; returns them."""
        removed = []
        model_dir = self.root / model_name
        if not model_dir.is_dir():
            return removed
        for d in model_dir.iterdir():
            m = _TMP.match(d.name)
            if m and d.is_dir() and not _pid_alive(int(m["pid"])):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        return removed

    @contextmanager
    def staging(self, model_name: str, engine_id: str, need_bytes: int = 0) -> Iterator[Path]:
        """A fresh temporary engine directory; removed on exit unless ``commit`` moved it.

        Refuses up front when the disk has less than ``need_bytes`` free, and turns a disk
        that fills up anyway into a BuildError that says how much was needed.
        """
        model_dir = self.root / model_name
        try:
            model_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._not_writable(model_dir, e) from e
        self.clean_stale(model_name)
        free = shutil.disk_usage(model_dir).free
        if need_bytes and free < need_bytes:
            raise BuildError(
                f"not enough disk space in {self.root}: the engine needs about "
                f"{format_bytes(need_bytes)} and {format_bytes(free)} is free",
                "free some space or pass --store on a larger disk",
                exit_code=EXIT_FAILURE,
            )
        tmp = model_dir / f".tmp-{engine_id}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
        except OSError as e:
            raise self._not_writable(tmp, e) from e
        try:
            yield tmp
        except BaseException as e:
            written = _dir_size(tmp) if tmp.exists() else 0
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, Exception) and _is_disk_full(e):
                need = max(need_bytes, written)
                raise BuildError(
                    f"disk full while writing the engine to {self.root}: it needs about "
                    f"{format_bytes(need)} and {format_bytes(free)} was free when the build began",
                    "free some space or pass --store on a larger disk; nothing was left behind",
                    exit_code=EXIT_FAILURE,
                ) from e
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def commit(self, tmp: Path, model_name: str, engine_id: str) -> Path:
        """Make the staged engine visible: sync its bytes, mark files read-only, rename."""
        final = self.engine_dir(model_name, engine_id)
        for p in tmp.rglob("*"):
            if p.is_file():
                _fsync(p)
                p.chmod(0o444)  # engines are immutable; this keeps honest tools from editing them
        _fsync(tmp)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and self.find(model_name, engine_id):
                return final  # a concurrent build of the same id won; ours is identical
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
