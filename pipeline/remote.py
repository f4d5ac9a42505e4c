"""`pipeline push` and `pipeline pull`: engines in a store that is not a folder (S3), or is.

Push checks every file of the engine against its manifest first (a store never receives
bytes the manifest does not vouch for), uploads the files, then the manifest, whose
presence commits the engine; an engine id already committed with other bytes is refused
(engines are immutable). A tag is a small object naming an engine id, moved by the next
push with the same tag. Pull resolves a tag, fetches every file, checks each against the
manifest, and writes the engine into the local cache that `serve launch` reads too.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from contract.errors import EXIT_FAILURE, BuildError
from contract.layout import MANIFEST_NAME
from contract.manifest import check_engine_files, read_manifest
from contract.refs import (
    PROBE_BYTES,
    PROBE_KEY,
    TagRecord,
    check_name,
    engine_key,
    manifest_key,
    parse_ref,
    tag_key,
)
from pipeline.progress import Progress, format_bytes
from runtime.store.cache import EngineCache
from runtime.store.objstore import ObjectStore, read_into_hashed
from runtime.store.source import StoreSource


@dataclass(frozen=True, slots=True)
class PushResult:
    url: str  # STORE/MODEL/ENGINE_ID
    uploaded: int  # bytes uploaded (0 when the store already held the engine)
    already: bool
    tag: str | None


def push(engine_dir: Path, store_uri: str, tag: str | None = None,
         progress: Progress | None = None) -> PushResult:
    progress = progress or Progress.silent()
    if tag is not None:
        try:
            check_name("tag", tag)
        except ValueError as e:
            raise BuildError(str(e), "choose another --tag") from None
    m = read_manifest(engine_dir)
    with progress.stage("verify", total=m.total_size, unit="B") as st:
        problems = check_engine_files(engine_dir, m, st.advance)
    if problems:
        listing = "; ".join(f"{p}: {why}" for p, why in problems)
        raise BuildError(f"{engine_dir} does not match its manifest ({listing}), so it is not "
                         "pushed", "rebuild the engine with `pipeline build`",
                         exit_code=EXIT_FAILURE)
    store = ObjectStore(store_uri)
    text = (engine_dir / MANIFEST_NAME).read_bytes()
    mkey = manifest_key(m.model_name, m.engine_id)
    existing = store.get_or_none(mkey)
    uploaded = 0
    if existing is not None and existing != text:
        raise _immutable(store, mkey)
    if existing is None:
        # The files first: an engine without its manifest is invisible to every reader, so
        # a push that dies here leaves nothing anyone serves (the next push rewrites them).
        with progress.stage("upload", total=m.total_size, unit="B") as st:
            for f in m.files:
                store.put(engine_key(m.model_name, m.engine_id, f.path), engine_dir / f.path)
                uploaded += f.size
                st.advance(f.size)
        if not store.put(mkey, text, create=True) and store.get(mkey) != text:
            raise _immutable(store, mkey)  # a concurrent push of other bytes won
    if store.head(PROBE_KEY) is None:  # what servers read to measure the store's floor
        store.put(PROBE_KEY, os.urandom(PROBE_BYTES), create=True)
    if tag is not None:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        rec = TagRecord(m.model_name, tag, m.engine_id, hashlib.sha256(text).hexdigest(), now)
        store.put(tag_key(m.model_name, tag), rec.to_bytes())
    url = store.url(engine_key(m.model_name, m.engine_id))
    return PushResult(url, uploaded, existing is not None, tag)


def _immutable(store: ObjectStore, mkey: str) -> BuildError:
    return BuildError(
        f"{store.url(mkey)} already holds an engine with this id but other bytes; engines are "
        "immutable, so it is not overwritten",
        "serve the engine already in the store, or push to another store",
        exit_code=EXIT_FAILURE)


@dataclass(frozen=True, slots=True)
class PullResult:
    engine_dir: Path
    engine_id: str
    fetched: int  # bytes read from the store
    cached: int  # bytes already in the cache (checked)
    tag: str | None


def pull(ref_text: str, cache: Path, progress: Progress | None = None) -> PullResult:
    progress = progress or Progress.silent()
    try:
        ref = parse_ref(ref_text)
    except ValueError as e:
        raise BuildError(str(e), "name the engine as STORE/MODEL@TAG or STORE/MODEL/ENGINE_ID") \
            from None
    cache_ = EngineCache(cache)
    src = StoreSource(ref, cache_)
    pinned = src.pin()
    m = src.adopt(pinned)
    model, eid = m.model_name, m.engine_id
    fetched = cached = 0
    with progress.stage("pull", total=m.total_size, unit="B") as st:
        for f in m.files:
            local = cache_.lookup(model, eid, f)
            if local is not None and _sha256_file(local) == f.sha256:
                cached += f.size
                st.advance(f.size)
                continue
            key = engine_key(model, eid, f.path)
            buf = bytearray(f.size)
            digest, _ = read_into_hashed(src.store, key, memoryview(buf))
            if digest != f.sha256:
                raise BuildError(f"{src.store.url(key)} does not match the manifest's sha256 "
                                 "(corrupted or modified in the store)",
                                 "push the engine again from a verified build",
                                 exit_code=EXIT_FAILURE)
            if not cache_.write(model, eid, f.path, buf):
                raise BuildError(f"cannot write {cache_.path(model, eid, f.path)}",
                                 "pass --cache with a directory you can write to",
                                 exit_code=EXIT_FAILURE)
            fetched += f.size
            st.advance(f.size)
    if not cache_.commit(m, src.manifest_text):
        raise BuildError(f"cannot complete {cache_.dir(model, eid)}",
                         "pass --cache with a directory you can write to",
                         exit_code=EXIT_FAILURE)
    return PullResult(cache_.dir(model, eid), eid, fetched, cached, ref.tag)


def _sha256_file(path: Path) -> str:
    from contract.manifest import hash_file

    try:
        return hash_file(path)
    except OSError:
        return ""


def describe_push(r: PushResult) -> str:
    what = "already in the store, nothing uploaded" if r.already else \
        f"uploaded {format_bytes(r.uploaded)}"
    return f"pushed    {r.url}  ({what})" + (f"\ntag       {r.tag} -> {r.url.rsplit('/', 1)[-1]}"
                                              if r.tag else "")


def describe_pull(r: PullResult) -> str:
    return (f"engine    {r.engine_id}" + (f"  (tag {r.tag})" if r.tag else "")
            + f"\nfetched   {format_bytes(r.fetched)}, from the cache {format_bytes(r.cached)}")
