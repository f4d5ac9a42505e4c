"""An engine's files as a process that runs the engine may read them.

An engine holds code (an AOTInductor package is a shared library; a tokenizer config can
name classes to load), so nothing of it is read unless the manifest lists it, and nothing
is read from the engine directory twice: each small file is read once, checked against
the manifest's size and sha256, and written to a private directory that the loaders then
open. Another process changing the engine directory after the check changes nothing we
load. (The weight shard is hashed while it is read into memory, runtime/store/loader.py, and
the bytes in memory are the ones served.) An engine in an object store is read the same
way, through a `reader` that fetches the object (runtime/store/source.py).

A worker killed outright (SIGKILL, the OOM killer) cannot remove its private directory, and
a supervisor that restarts it would fill the temp directory copy by copy. So each directory
holds an owner lock (flock, released by the kernel when its process dies however it dies),
and every new EngineFiles first removes the directories whose lock nobody holds.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from contract.errors import EXIT_FAILURE, BuildError
from contract.manifest import FileEntry, Manifest

_OPEN: list[EngineFiles] = []
_PREFIX = "aotllm-verified-"
_OWNER = ".owner"  # the lock file; present only while locked (see _own)


def _own(d: Path) -> int:
    """Lock `d` for this process: the lock is taken under a temporary name and only then
    renamed to _OWNER, so a sweeper never sees an _OWNER that is not locked."""
    fd = os.open(d / ".owner-new", os.O_CREAT | os.O_WRONLY, 0o600)  # O_CLOEXEC by default
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(d / ".owner-new", d / _OWNER)
    return fd


def sweep_orphans(tmp: Path | None = None) -> list[Path]:
    """Remove the private directories of processes that died without closing them."""
    removed = []
    for d in Path(tmp or tempfile.gettempdir()).glob(_PREFIX + "*"):
        try:
            fd = os.open(d / _OWNER, os.O_RDONLY)
        except OSError:
            continue  # being created, or not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner is alive
        finally:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


class EngineFiles:
    def __init__(self, engine_dir: Path, manifest: Manifest,
                 reader: Callable[[FileEntry], bytes] | None = None,
                 where: str | None = None) -> None:
        self.engine_dir = engine_dir
        self.where = where or str(engine_dir)  # for messages: a directory or a store URL
        self.reader = reader  # None: read from engine_dir
        self.entries: dict[str, FileEntry] = {f.path: f for f in manifest.files}
        sweep_orphans()
        self.dir = Path(tempfile.mkdtemp(prefix=_PREFIX))  # mode 0700
        self._owner = _own(self.dir)
        self.verified: list[str] = []
        _OPEN.append(self)

    def listed(self, name: str) -> bool:
        return name in self.entries

    def require(self, name: str) -> FileEntry:
        """The manifest's entry for `name`, or a refusal naming the file."""
        entry = self.entries.get(name)
        if entry is None:
            raise BuildError(
                f"{name} is not listed in the engine's manifest, so it is not read "
                "(an engine holds code: only files the manifest hashes are loaded)",
                "rebuild the engine with `pipeline build`, or restore its manifest",
                exit_code=EXIT_FAILURE)
        return entry

    def check(self, name: str, sha256: str) -> None:
        """`sha256` (of bytes already read, e.g. a shard hashed while loading) must be the
        manifest's for `name`."""
        if self.require(name).sha256 != sha256:
            raise self._mismatch(name)

    def _mismatch(self, name: str) -> BuildError:
        return BuildError(f"{name} does not match the manifest's sha256 (corrupted or modified)",
                          f"restore or rebuild the engine; `pipeline verify {self.where}` "
                          "lists every bad file", exit_code=EXIT_FAILURE)

    def missing(self, names: list[str]) -> list[str]:
        """Those of `names` (listed files) absent from the engine directory or of another
        size than the manifest says: a cheap check before any byte is read."""
        bad = []
        for name in names:
            try:
                size = (self.engine_dir / name).stat().st_size
            except OSError:
                size = -1
            if size != self.require(name).size:
                bad.append(name)
        return bad

    def get(self, name: str) -> Path:
        """The private, verified copy of `name` (read and checked once)."""
        copy = self.dir / PurePosixPath(name)
        if name in self.verified:
            return copy
        entry = self.require(name)
        try:
            data = (self.engine_dir / name).read_bytes() if self.reader is None \
                else self.reader(entry)
        except OSError as e:
            raise BuildError(f"cannot read {name} ({e.strerror or e})",
                             f"restore or rebuild the engine in {self.engine_dir}",
                             exit_code=EXIT_FAILURE) from None
        if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise self._mismatch(name)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(data)
        self.verified.append(name)
        return copy

    def get_listed(self, names: tuple[str, ...]) -> list[Path]:
        """Verified copies of those of `names` the manifest lists (optional files)."""
        return [self.get(n) for n in names if self.listed(n)]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._owner >= 0:
            os.close(self._owner)
            self._owner = -1
        if self in _OPEN:
            _OPEN.remove(self)


def close_all() -> None:
    """Remove every private copy (before the process exits, which skips atexit)."""
    for files in list(_OPEN):
        files.close()
