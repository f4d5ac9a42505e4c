"""Unpack a rank's AOTInductor package once, at build time.

`rank{N}.pt2` is a zip that torch's package loader unpacks into a fresh temporary
directory at every load. The loader also takes an unpacked directory, so the build writes
the files it needs beside the package, as `rank{N}.aoti/`: the compiled library and its
metadata (not the C++ sources the zip also carries). They are engine files like any other:
listed and hashed in the manifest, verified before the server loads them.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path, PurePosixPath

from contract.errors import EXIT_FAILURE, BuildError

_SKIP_SUFFIXES = (".cpp",)  # sources: in the .pt2 for whoever wants to read them


def extract_package(pt2: Path, out: Path) -> list[Path]:
    """Write the loadable files of `pt2` under `out` (the archive's top directory dropped)."""
    written: list[Path] = []
    with zipfile.ZipFile(pt2) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            parts = PurePosixPath(info.filename).parts
            rel = PurePosixPath(*parts[1:]) if len(parts) > 1 else PurePosixPath()
            if not rel.parts or rel.suffix in _SKIP_SUFFIXES:
                continue
            if rel.is_absolute() or ".." in rel.parts:
                raise BuildError(f"{pt2.name} holds an unsafe path {info.filename!r}",
                                 "rebuild the engine", exit_code=EXIT_FAILURE)
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, dest.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            written.append(dest)
    if not any(p.suffix == ".so" for p in written):
        raise BuildError(f"{pt2.name} holds no compiled library", "rebuild the engine",
                         exit_code=EXIT_FAILURE)
    return written
