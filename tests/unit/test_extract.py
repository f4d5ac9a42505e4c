"""pipeline/compile/extract.py: a rank's AOTInductor package unpacked once, at build."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from contract.errors import BuildError
from pipeline.compile.extract import extract_package


def _pt2(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_loadable_files_kept_sources_dropped(tmp_path: Path) -> None:
    pt2 = _pt2(tmp_path / "rank0.pt2", {
        "model/archive_format": b"pt2", "model/data/aotinductor/model/m.so": b"\x7fELF",
        "model/data/aotinductor/model/m.cpp": b"// source", "model/data/aotinductor/model/m.json":
        b"{}"})
    written = extract_package(pt2, tmp_path / "rank0.aoti")
    rel = sorted(str(p.relative_to(tmp_path / "rank0.aoti")) for p in written)
    assert rel == ["archive_format", "data/aotinductor/model/m.json",
                   "data/aotinductor/model/m.so"]
    assert (tmp_path / "rank0.aoti/data/aotinductor/model/m.so").read_bytes() == b"\x7fELF"


@pytest.mark.parametrize("members, why", [
    ({"model/../../evil.so": b"x"}, "unsafe path"),
    ({"model/data/only.cpp": b"x"}, "no compiled library"),
])
def test_bad_packages_are_refused(tmp_path: Path, members: dict[str, bytes], why: str) -> None:
    with pytest.raises(BuildError, match=why):
        extract_package(_pt2(tmp_path / "p.pt2", members), tmp_path / "out")
    assert not (tmp_path / "evil.so").exists()
