"""Where a serving rank reads its engine from: a local directory, or an engine store
(S3 or a local store directory) through a local cache keyed by engine id.

`pin` (rank 0 at start-up) turns `STORE/MODEL@TAG` into an engine id and reads that
engine's manifest; every rank then opens the same pinned engine. From a store each rank
reads only what it loads: the manifest, its own shard (parallel ranged reads straight into
memory, hashed as the parts arrive) and the small files its gates ask for (verified, then
written to the private directory of runtime/store/files.py). Whatever was verified is
also written to the cache (`<cache>/<model>/<engine-id>/`, each file atomically, the
manifest last once every file is there), so the next start on this host reads locally; a
cached file is hashed like any other before use, and one that fails is fetched again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.errors import EXIT_FAILURE, BuildError
from contract.layout import MANIFEST_NAME
from contract.manifest import FileEntry, Manifest, read_manifest
from contract.refs import (
    EngineRef,
    TagRecord,
    engine_key,
    manifest_key,
    parse_ref,
    tag_key,
)
from runtime.store.cache import EngineCache
from runtime.store.files import EngineFiles

if TYPE_CHECKING:  # the loader imports torch: the launcher only resolves, it loads nothing
    from runtime.store.loader import LoadedShard

log = logging.getLogger("runtime.store.source")


def manifest_from_text(text: str, where: str) -> Manifest:
    try:
        return Manifest.from_dict(json.loads(text))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BuildError(f"cannot read the manifest {where} ({e})", "push the engine again",
                         exit_code=EXIT_FAILURE) from None
    except ValueError as e:
        raise BuildError(f"{where}: {e}", "rebuild the engine with this version of the pipeline",
                         exit_code=EXIT_FAILURE) from None
    except (KeyError, TypeError, AttributeError) as e:
        raise BuildError(f"{where} is malformed (bad or missing field {e})",
                         "push the engine again", exit_code=EXIT_FAILURE) from None


def _mismatch(where: str) -> BuildError:
    return BuildError(f"{where} does not match the manifest's sha256 (corrupted or modified)",
                      "push the engine again from a verified build (`pipeline verify`, then "
                      "`pipeline push`)", exit_code=EXIT_FAILURE)


def resolve_tag(store: Any, ref: EngineRef) -> TagRecord:
    """The tag object `ref` names (store: runtime.store.objstore.ObjectStore)."""
    assert ref.tag is not None
    data = store.get(tag_key(ref.model, ref.tag))
    try:
        rec = TagRecord.from_bytes(data)
    except ValueError as e:
        raise BuildError(f"{store.url(tag_key(ref.model, ref.tag))}: {e}",
                         "move the tag again with `pipeline push ... --tag`",
                         exit_code=EXIT_FAILURE) from None
    return rec


@dataclass
class Pinned:
    """What rank 0 resolved: the engine every rank serves, and how it was found."""

    engine_id: str
    manifest_text: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "manifest": self.manifest_text,
                "evidence": self.evidence}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Pinned:
        return cls(d["engine_id"], d["manifest"], d["evidence"])


class EngineSource:
    """A local engine directory: today's behaviour (and what a cache hit becomes)."""

    kind = "directory"

    def __init__(self, engine_dir: Path) -> None:
        self.local_dir: Path | None = Path(engine_dir)
        self.where = str(engine_dir)
        self.manifest: Manifest | None = None
        self.files: EngineFiles | None = None

    @property
    def verify_hint(self) -> str:
        return f"`pipeline verify {self.where}` lists every bad file"

    def open(self, manifest: Manifest) -> EngineFiles:
        assert self.local_dir is not None
        self.manifest = manifest
        self.files = EngineFiles(self.local_dir, manifest)
        return self.files

    def read_manifest(self) -> Manifest:
        assert self.local_dir is not None
        return read_manifest(self.local_dir)

    def shard_path(self, name: str) -> Path:
        assert self.local_dir is not None
        return self.local_dir / name

    def load_shard(self, name: str, device: str) -> tuple[LoadedShard, dict[str, Any]]:
        from runtime.store.loader import load_shard

        return load_shard(self.shard_path(name), device), {"from": "directory"}

    def keep(self, name: str, shard: LoadedShard) -> None:
        """After verify: nothing to keep for a local directory."""

    def finish(self) -> dict[str, Any]:
        return {}


class StoreSource(EngineSource):
    """An engine in a store (S3), read by each rank through the cache."""

    kind = "store"

    def __init__(self, ref: EngineRef, cache: EngineCache | None, store: Any = None,
                 deadline: float | None = None) -> None:
        from runtime.store.objstore import ObjectStore

        self.ref = ref
        self.store = store or ObjectStore(ref.store, deadline)
        self.cache = cache
        self.local_dir = None
        self.where = str(ref)
        self.manifest = None
        self.files = None
        self.manifest_text = ""
        self.fetched: dict[str, int] = {}  # name -> bytes read from the store
        self.cached: list[str] = []  # names served from the cache

    @property
    def verify_hint(self) -> str:
        return (f"`pipeline pull {self.where}` fetches and checks every file"
                + (f" (the cache is {self.cache.root})" if self.cache else ""))

    @property
    def engine_id(self) -> str:
        assert self.ref.engine_id is not None
        return self.ref.engine_id

    @property
    def local(self) -> bool:
        """A store directory (no S3): its engines are engine directories already."""
        return not self.ref.remote

    def engine_dir(self) -> Path:
        return Path(self.ref.store) / self.ref.model / self.engine_id

    def key(self, name: str) -> str:
        return engine_key(self.ref.model, self.engine_id, name)

    def pin(self) -> Pinned:
        """Rank 0: the engine id (a tag's, or the ref's own) and its manifest (the cache's
        when it is the one the tag names, else the store's)."""
        t0 = time.perf_counter()
        ev: dict[str, Any] = {"ref": str(self.ref)}
        want_sha: str | None = None
        if self.ref.tag is not None:
            rec = resolve_tag(self.store, self.ref)
            eid, want_sha = rec.engine_id, rec.manifest_sha256
            ev.update(tag=self.ref.tag, tag_pushed_at=rec.pushed_at,
                      tag_s=round(time.perf_counter() - t0, 4))
        else:
            eid = self.engine_id
        text = self.cache.manifest_text(self.ref.model, eid) if self.cache else None
        if text is not None and want_sha is not None and \
                hashlib.sha256(text.encode()).hexdigest() != want_sha:
            text = None  # not the manifest the tag pins: ask the store
        ev["manifest_from"] = "cache" if text is not None else "store"
        if text is None:
            key = manifest_key(self.ref.model, eid)
            raw = self.store.get(key)
            if want_sha is not None and hashlib.sha256(raw).hexdigest() != want_sha:
                raise _mismatch(f"{self.store.url(key)} (pinned by tag {self.ref.tag})")
            text = raw.decode("utf-8", errors="replace")
        ev.update(engine_id=eid, manifest_sha256=hashlib.sha256(text.encode()).hexdigest()[:16],
                  pin_s=round(time.perf_counter() - t0, 4))
        return Pinned(eid, text, ev)

    def adopt(self, pinned: Pinned) -> Manifest:
        """Every rank: serve the pinned engine."""
        self.ref = self.ref.pinned(pinned.engine_id)
        self.manifest_text = pinned.manifest_text
        where = self.store.url(manifest_key(self.ref.model, pinned.engine_id))
        m = manifest_from_text(pinned.manifest_text, where)
        if m.engine_id != pinned.engine_id or m.model_name != self.ref.model:
            raise BuildError(f"{where} describes engine {m.model_name}/{m.engine_id}, not "
                             f"{self.ref.model}/{pinned.engine_id}", "push the engine again",
                             exit_code=EXIT_FAILURE)
        return m

    def open(self, manifest: Manifest) -> EngineFiles:
        self.manifest = manifest
        self.files = EngineFiles(Path(self.where), manifest, reader=self._read_small,
                                 where=self.where)
        return self.files

    def _read_small(self, entry: FileEntry) -> bytes:
        """A small file's bytes, verified: the cache's when they check, else the store's."""
        if self.cache is not None:
            p = self.cache.lookup(self.ref.model, self.engine_id, entry)
            if p is not None:
                with contextlib.suppress(OSError):
                    data = p.read_bytes()
                    if hashlib.sha256(data).hexdigest() == entry.sha256:
                        self.cached.append(entry.path)
                        return data
                    log.warning("cached %s does not match the manifest; fetching it again", p)
        data = self.store.get(self.key(entry.path))
        self.fetched[entry.path] = len(data)
        if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise _mismatch(self.store.url(self.key(entry.path)))
        if self.cache is not None:
            self.cache.write(self.ref.model, self.engine_id, entry.path, data)
        return data

    def shard_path(self, name: str) -> Path:
        return Path(self.store.url(self.key(name)))

    def load_shard(self, name: str, device: str) -> tuple[LoadedShard, dict[str, Any]]:
        from runtime.store.loader import load_shard

        assert self.files is not None
        entry = self.files.require(name)
        if self.cache is not None:
            p = self.cache.lookup(self.ref.model, self.engine_id, entry)
            if p is not None:
                shard = load_shard(p, device)
                if shard.sha256 == entry.sha256:
                    self.cached.append(name)
                    return shard, {"from": "cache", "cache": str(p)}
                log.warning("cached %s does not match the manifest; fetching it again", p)
                del shard
        key = self.key(name)
        shard = load_shard(Path(self.store.url(key)), device, store=self.store, key=key,
                           size=entry.size)
        self.fetched[name] = entry.size
        return shard, {"from": "store", "object": self.store.url(key)}

    def keep(self, name: str, shard: LoadedShard) -> None:
        """After verify: a shard read from the store goes to the cache (from host memory)."""
        if self.cache is None or name not in self.fetched or shard.buffer is None:
            return
        buf = shard.buffer if shard.buffer.device.type == "cpu" else shard.buffer.cpu()
        self.cache.write(self.ref.model, self.engine_id, name, buf.numpy())

    def finish(self) -> dict[str, Any]:
        """Rank 0 once every rank has verified (and cached) its files."""
        done = False
        if self.cache is not None and self.manifest is not None:
            done = self.cache.commit(self.manifest, self.manifest_text)
        return {"cache": str(self.cache.dir(self.ref.model, self.engine_id))
                if self.cache else None, "cache_complete": done}


def open_source(engine: str, cache: Path | None, store: Any = None,
                deadline: float | None = None) -> EngineSource:
    """`--engine`: an engine directory, `STORE/MODEL@TAG` or `STORE/MODEL/ID` (S3 or a
    store directory). Raises BuildError saying what is wrong."""
    path = Path(engine)
    if not str(engine).startswith("s3://") and (path / MANIFEST_NAME).is_file():
        return EngineSource(path)
    try:
        ref = parse_ref(engine)
    except ValueError as e:
        if str(engine).startswith("s3://"):
            raise BuildError(str(e), "name the engine as s3://BUCKET/PREFIX/MODEL@TAG or "
                             "s3://BUCKET/PREFIX/MODEL/ENGINE_ID") from None
        return EngineSource(path)  # read_manifest says what is wrong with the directory
    if not ref.remote and ref.engine_id is not None:
        return EngineSource(path)
    return StoreSource(ref, EngineCache(cache) if cache is not None and ref.remote else None,
                       store, deadline)


def engine_tp(engine: str, cache: Path | None, deadline: float | None = None) -> int:
    """The TP of the engine `--engine` names (the launcher starts that many ranks)."""
    source = open_source(engine, cache, deadline=deadline)
    if isinstance(source, StoreSource):
        return source.adopt(source.pin()).tp
    return source.read_manifest().tp
