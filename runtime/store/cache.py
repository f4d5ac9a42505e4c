"""The local cache of engines read from a store: `<root>/<model>/<engine-id>/`, the layout
of a store directory. Files land atomically (never a partial file under its final name)
and the manifest is written last, once every file is there, so a complete entry is an
engine directory (`pipeline verify`, `--engine`). Keyed by engine id, which is never
reused for other bytes: nothing here is ever invalidated, and a reader hashes every
cached file before use anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from contract.layout import MANIFEST_NAME
from contract.manifest import FileEntry, Manifest
from runtime.env import cache_root

log = logging.getLogger("runtime.store.cache")


def default_cache() -> Path:
    """Where pulled engines live, keyed like a store (`<model>/<engine-id>/`):
    $AOT_LLM_CACHE/engines, or ~/.cache/aot-llm/engines. `pipeline pull` writes it and
    `serve launch` reads (and fills) it."""
    return cache_root() / "engines"


class EngineCache:
    """`<root>/<model>/<engine-id>/`: the layout of a store directory, so a complete cached
    engine (manifest written) is also an engine directory (`pipeline verify`, `--engine`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser()

    def dir(self, model: str, engine_id: str) -> Path:
        return self.root / model / engine_id

    def path(self, model: str, engine_id: str, name: str) -> Path:
        return self.dir(model, engine_id) / name

    def lookup(self, model: str, engine_id: str, entry: FileEntry) -> Path | None:
        """The cached file when it is there with the manifest's size (hash checked by the
        reader, as for any engine file)."""
        p = self.path(model, engine_id, entry.path)
        try:
            return p if p.stat().st_size == entry.size else None
        except OSError:
            return None

    def write(self, model: str, engine_id: str, name: str, data: Any) -> bool:
        """Write verified bytes atomically (never a partial file under the final name);
        best effort: a cache that cannot be written only costs the next start a fetch."""
        final = self.path(model, engine_id, name)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(memoryview(data).cast("B"))
            tmp.chmod(0o444)
            os.replace(tmp, final)
            return True
        except OSError as e:
            log.warning("cannot cache %s (%s); the next start fetches it again", final,
                        e.strerror or e)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False

    def manifest_text(self, model: str, engine_id: str) -> str | None:
        try:
            return self.path(model, engine_id, MANIFEST_NAME).read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def commit(self, manifest: Manifest, text: str) -> bool:
        """Write the manifest once every file is cached with its size: the entry is then a
        complete engine directory. Returns whether it is complete."""
        m = manifest
        if any(self.lookup(m.model_name, m.engine_id, f) is None for f in m.files):
            return False
        if self.manifest_text(m.model_name, m.engine_id) == text:
            return True
        return self.write(m.model_name, m.engine_id, MANIFEST_NAME, text.encode())
