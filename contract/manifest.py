"""The engine manifest (docs/design.md §3): what an engine is and the hash of every file in it.

The build writes it last, just before the engine directory is renamed into place; the server
reads it first (gate 1) and checks every byte it loads against it (gate 5).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from contract.errors import BuildError
from contract.layout import MANIFEST_NAME, WEIGHT_LAYOUTS
from contract.profile import BuildProfile
from contract.quant import NONE, Quantization
from contract.speculative import Speculative
from contract.target import Target

SCHEMA_VERSION = 1
SUPPORTED_SCHEMAS = (1,)
ENGINE_ID_HEX = 16
CHUNK = 8 << 20  # 8 MiB reads: large enough for full disk speed, small enough for progress
_RANK_FILE = re.compile(r"^rank(\d+)\.")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A build stages an engine in <model>/.tmp-<engine-id>-<pid>-<tag>/ and renames it into place
# when complete: a directory with this prefix is a build in progress (or one that died), never
# an engine, even when its manifest is already written.
STAGING_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative to the engine directory, POSIX separators
    rank: int | None  # the TP rank that loads it; None for files every rank shares
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise ValueError(f"file path {self.path!r} is not a string")
        p = PurePosixPath(self.path)
        # A manifest must never point outside its own directory, nor at the directory itself.
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise ValueError(f"file path {self.path!r} is not inside the engine directory")
        if p.as_posix() == MANIFEST_NAME:
            raise ValueError(f"file path {self.path!r} is the manifest itself")
        if self.rank is not None and (type(self.rank) is not int or self.rank < 0):
            raise ValueError(f"file {self.path!r}: rank {self.rank!r} is not a rank number")
        if type(self.size) is not int or self.size < 0:
            raise ValueError(f"file {self.path!r}: size {self.size!r} is not a byte count")
        if not isinstance(self.sha256, str) or not _SHA256.match(self.sha256):
            raise ValueError(f"file {self.path!r}: sha256 {self.sha256!r} is not a sha256 digest")


@dataclass(frozen=True, slots=True)
class Source:
    uri: str  # as the user gave it
    revision: str | None  # the immutable revision it resolved to (hf commit, gguf sha256)
    digest: str  # checkpoint_digest over the checkpoint files
    # What the weights were stored as before the build, when not plain floats (a GGUF's
    # block types: "GGUF Q4_K_M: Q4_K x27, Q6_K x9, ..."); recorded only when set.
    format: str = ""


@dataclass(frozen=True, slots=True)
class Manifest:
    engine_id: str
    model_name: str
    source: Source
    backend: str
    target: Target
    tp: int
    dtype: str
    profile: BuildProfile
    toolchain: dict[str, str]
    files: tuple[FileEntry, ...]
    golden: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    quant: Quantization = NONE  # recorded only when the engine is quantized
    weight_layout: str = "rows"  # recorded only when not row-major (contract/layout.py)
    # The engine against transformers float32 on a fixed text, beside transformers' own
    # 16-bit figures (pipeline/fidelity.py); recorded only when measured or skipped.
    fidelity: dict[str, Any] = field(default_factory=dict)
    # The drafter `serve launch` runs unless told otherwise (`--speculative`); recorded only
    # when the build chose one.
    speculative: Speculative | None = None

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def rank_files(self, rank: int) -> list[FileEntry]:
        """The files rank ``rank`` loads: its own plus the shared ones."""
        return [f for f in self.files if f.rank in (None, rank)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "engine_id": self.engine_id,
            "model_name": self.model_name,
            "source": {
                "uri": self.source.uri,
                "revision": self.source.revision,
                "digest": self.source.digest,
                **({"format": self.source.format} if self.source.format else {}),
            },
            "backend": self.backend,
            "target": self.target.to_dict(),
            "tp": self.tp,
            "dtype": self.dtype,
            **({"quant": self.quant.to_dict()} if self.quant.enabled else {}),
            **({"weight_layout": self.weight_layout} if self.weight_layout != "rows" else {}),
            **({"speculative": self.speculative.to_json()} if self.speculative else {}),
            "profile": self.profile.to_dict(),
            "toolchain": dict(self.toolchain),
            "files": [
                {"path": f.path, "rank": f.rank, "size": f.size, "sha256": f.sha256}
                for f in self.files
            ],
            "golden": self.golden,
            **({"fidelity": self.fidelity} if self.fidelity else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        if not isinstance(d, dict):
            raise ValueError(f"the manifest is a JSON {type(d).__name__}, not an object")
        version = d.get("schema_version")
        if version not in SUPPORTED_SCHEMAS:
            raise ValueError(
                f"manifest schema_version {version!r} is not supported (this build reads "
                f"{', '.join(map(str, SUPPORTED_SCHEMAS))})"
            )
        src = d["source"]
        files = tuple(
            FileEntry(f["path"], f["rank"], f["size"], f["sha256"]) for f in d["files"]
        )
        seen: set[str] = set()
        for f in files:
            norm = PurePosixPath(f.path).as_posix()
            if norm in seen:
                raise ValueError(f"file path {f.path!r} is listed twice")
            seen.add(norm)
        tp = d["tp"]
        if type(tp) is not int or tp < 1:
            raise ValueError(f"tp {tp!r} is not a positive integer")
        return cls(
            schema_version=version,
            engine_id=str(d["engine_id"]),
            model_name=str(d["model_name"]),
            source=Source(uri=src["uri"], revision=src.get("revision"), digest=src["digest"],
                          format=str(src.get("format", ""))),
            backend=d["backend"],
            target=Target.from_dict(d["target"]),
            tp=tp,
            dtype=d["dtype"],
            quant=Quantization.from_dict(d.get("quant")),
            weight_layout=_weight_layout(d.get("weight_layout", "rows")),
            profile=BuildProfile(**d["profile"]),
            toolchain={str(k): str(v) for k, v in d["toolchain"].items()},
            files=files,
            golden=dict(d.get("golden") or {}),
            fidelity=dict(d.get("fidelity") or {}),
            speculative=Speculative.from_json(d.get("speculative")),
        )


def rank_of(path: str) -> int | None:
    """rank{N}.* belongs to rank N, and so does everything under a rank{N}.* directory."""
    m = _RANK_FILE.match(PurePosixPath(path).parts[0])
    return int(m.group(1)) if m else None


def _weight_layout(value: object) -> str:
    if value not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout {value!r} is not one of {', '.join(WEIGHT_LAYOUTS)}")
    return str(value)


def engine_inputs(
    *,
    source_digest: str,
    backend: str,
    target: Target,
    tp: int,
    dtype: str,
    profile: BuildProfile,
    toolchain: dict[str, str],
    quant: Quantization = NONE,
    weight_layout: str = "rows",
    speculative: Speculative | None = None,
) -> dict[str, Any]:
    """Everything that determines an engine's bytes, as plain JSON data (the manifest's
    included). The quantization, a weight layout other than row-major and a drafter enter
    only when there is one, so the other engines keep the ids they always had."""
    return {
        **({"quant": quant.to_dict()} if quant.enabled else {}),
        **({"weight_layout": weight_layout} if weight_layout != "rows" else {}),
        **({"speculative": speculative.to_json()} if speculative else {}),
        "schema_version": SCHEMA_VERSION,
        "source_digest": source_digest,
        "backend": backend,
        "target": target.to_dict(),
        "tp": tp,
        "dtype": dtype,
        "profile": profile.to_dict(),
        "toolchain": dict(toolchain),
    }


def engine_id(inputs: dict[str, Any]) -> str:
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:ENGINE_ID_HEX]


OnBytes = Callable[[int], None]  # told how many bytes were just read (progress display)


def hash_file(path: Path, on_bytes: OnBytes | None = None) -> str:
    """Streamed sha256 of a file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return h.hexdigest()


def engine_files(engine_dir: Path) -> list[Path]:
    """Every file under ``engine_dir`` except the manifest itself, in manifest order."""
    return sorted(
        (p for p in engine_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME),
        key=lambda p: p.relative_to(engine_dir).as_posix(),
    )


def hash_engine_files(engine_dir: Path, on_bytes: OnBytes | None = None) -> tuple[FileEntry, ...]:
    """A FileEntry for every file under ``engine_dir`` except the manifest itself."""
    entries = []
    for p in engine_files(engine_dir):
        rel = p.relative_to(engine_dir).as_posix()
        entries.append(FileEntry(rel, rank_of(rel), p.stat().st_size, hash_file(p, on_bytes)))
    return tuple(entries)


def write_manifest(engine_dir: Path, manifest: Manifest) -> Path:
    path = engine_dir / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(engine_dir: Path) -> Manifest:
    name = Path(engine_dir).absolute().name
    if name.startswith(STAGING_PREFIX):
        raise BuildError(
            f"{engine_dir} is the staging directory of a build that is running or died, "
            "not an engine",
            "use the engine directory pipeline build prints as its last line",
        )
    path = Path(engine_dir) / MANIFEST_NAME
    if not path.is_file():
        hint = "pipeline build prints the engine directory as its last line"
        if not Path(engine_dir).is_dir():
            raise BuildError(f"engine directory {engine_dir} does not exist", hint)
        raise BuildError(f"{engine_dir} has no {MANIFEST_NAME}, so it is not an engine", hint)
    try:
        return Manifest.from_dict(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BuildError(f"cannot read {path} ({e})", "rebuild the engine") from e
    except ValueError as e:  # unsupported schema, invalid profile or target, unsafe path
        raise BuildError(
            f"{path}: {e}", "rebuild the engine with this version of the pipeline"
        ) from e
    except (KeyError, TypeError, AttributeError) as e:
        raise BuildError(
            f"{path} is malformed (bad or missing field {e})", "rebuild the engine"
        ) from e


def check_engine_files(
    engine_dir: Path, manifest: Manifest, on_bytes: OnBytes | None = None
) -> list[tuple[str, str]]:
    """(path, reason) for every file that is missing, resized, altered, or not in the manifest."""
    problems: list[tuple[str, str]] = []
    listed = {f.path for f in manifest.files}
    for f in manifest.files:
        p = engine_dir / f.path
        if not p.is_file():
            problems.append((f.path, "missing"))
        elif (size := p.stat().st_size) != f.size:
            problems.append((f.path, f"size {size} != {f.size} in the manifest"))
        elif hash_file(p, on_bytes) != f.sha256:
            problems.append((f.path, "sha256 does not match the manifest"))
    for p in engine_files(engine_dir):
        rel = p.relative_to(engine_dir).as_posix()
        if rel not in listed:
            problems.append((rel, "not listed in the manifest"))
    return problems

