"""Engine references and the layout of an engine store, as data.

A store holds engines the way a local store directory does, under a root that is a local
directory or an S3 prefix (`s3://bucket/prefix`):

    <root>/<model>/<engine-id>/<file>     an engine's files; manifest.json is written last
                                           and its presence commits the engine
    <root>/<model>/tags/<tag>             a small mutable JSON object naming an engine id
    <root>/.aotllm/probe                  random bytes the server reads to measure the
                                           store's read floor

An engine is named by `STORE/MODEL/ENGINE_ID` (immutable) or `STORE/MODEL@TAG` (resolved
to an id when read). Engine ids are never reused for different bytes, so anything keyed by
id (a local cache) never needs invalidating.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from contract.layout import MANIFEST_NAME
from contract.manifest import ENGINE_ID_HEX

S3_SCHEME = "s3://"
TAGS_DIR = "tags"
PROBE_KEY = ".aotllm/probe"
PROBE_BYTES = 32 << 20
TAG_SCHEMA = 1
_ID = re.compile(rf"^[0-9a-f]{{{ENGINE_ID_HEX}}}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # model and tag names
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def is_remote(text: str) -> bool:
    return str(text).startswith(S3_SCHEME)


def is_engine_id(text: str) -> bool:
    return bool(_ID.match(text))


def check_name(kind: str, name: str) -> str:
    if not _NAME.match(name) or name == TAGS_DIR:
        raise ValueError(f"{kind} {name!r} is not a valid name (letters, digits, '.', '_', '-'; "
                         f"not {TAGS_DIR!r})")
    return name


@dataclass(frozen=True, slots=True)
class EngineRef:
    """`store/model@tag` or `store/model/engine_id`; `store` is a directory or s3://."""

    store: str
    model: str
    tag: str | None = None
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if (self.tag is None) == (self.engine_id is None):
            raise ValueError("an engine reference names a tag or an engine id, not both")
        check_name("model", self.model)
        if self.tag is not None:
            check_name("tag", self.tag)
        if self.engine_id is not None and not is_engine_id(self.engine_id):
            raise ValueError(f"{self.engine_id!r} is not an engine id ({ENGINE_ID_HEX} hex digits)")

    @property
    def remote(self) -> bool:
        return is_remote(self.store)

    def pinned(self, engine_id: str) -> EngineRef:
        """The same engine by its immutable id."""
        return EngineRef(self.store, self.model, engine_id=engine_id)

    def __str__(self) -> str:
        tail = f"{self.model}@{self.tag}" if self.tag else f"{self.model}/{self.engine_id}"
        return f"{self.store.rstrip('/')}/{tail}"


def parse_ref(text: str) -> EngineRef:
    """`STORE/MODEL@TAG` or `STORE/MODEL/ENGINE_ID`; ValueError saying what is wrong."""
    text = str(text).rstrip("/")
    head, _, last = text.rpartition("/")
    if not head or not last:
        raise ValueError(f"{text!r} is not STORE/MODEL@TAG or STORE/MODEL/ENGINE_ID")
    if "@" in last:
        model, _, tag = last.partition("@")
        store = head
        ref = EngineRef(store, model, tag=tag)
    else:
        store, _, model = head.rpartition("/")
        if not store or not is_engine_id(last):
            raise ValueError(f"{text!r} is not STORE/MODEL@TAG or STORE/MODEL/ENGINE_ID "
                             f"(an engine id is {ENGINE_ID_HEX} hex digits)")
        ref = EngineRef(store, model, engine_id=last)
    if ref.remote and not split_s3(ref.store)[0]:
        raise ValueError(f"{text!r}: the store names no bucket (s3://BUCKET[/PREFIX])")
    return ref


def split_s3(uri: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix")."""
    rest = uri[len(S3_SCHEME):] if uri.startswith(S3_SCHEME) else uri
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


# ---- keys, relative to the store's root --------------------------------------------------


def engine_key(model: str, engine_id: str, path: str = "") -> str:
    return f"{model}/{engine_id}/{path}" if path else f"{model}/{engine_id}"


def manifest_key(model: str, engine_id: str) -> str:
    return engine_key(model, engine_id, MANIFEST_NAME)


def tag_key(model: str, tag: str) -> str:
    return f"{model}/{TAGS_DIR}/{tag}"


# ---- tags ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TagRecord:
    model: str
    tag: str
    engine_id: str
    manifest_sha256: str  # pins the manifest too: a reader checks the one it fetches
    pushed_at: str = ""  # ISO 8601, informational

    def to_bytes(self) -> bytes:
        d = {"schema": TAG_SCHEMA, "model": self.model, "tag": self.tag,
             "engine_id": self.engine_id, "manifest_sha256": self.manifest_sha256,
             "pushed_at": self.pushed_at}
        return (json.dumps(d, indent=2) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TagRecord:
        try:
            d: Any = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"the tag is not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("schema") != TAG_SCHEMA:
            raise ValueError(f"the tag's schema is not {TAG_SCHEMA}")
        eid, sha = d.get("engine_id"), d.get("manifest_sha256")
        if not isinstance(eid, str) or not is_engine_id(eid):
            raise ValueError(f"the tag's engine_id {eid!r} is not an engine id")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise ValueError(f"the tag's manifest_sha256 {sha!r} is not a sha256 digest")
        return cls(str(d.get("model", "")), str(d.get("tag", "")), eid, sha,
                   str(d.get("pushed_at", "")))
