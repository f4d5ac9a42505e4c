"""contract.manifest: what a manifest refuses (paths outside the engine, a bad schema, a staging
directory) and what check_engine_files reports (missing, resized, altered, unlisted files)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from contract.errors import EXIT_BAD_INPUT, BuildError
from contract.layout import weight_layout_for
from contract.manifest import (
    FileEntry,
    Manifest,
    Source,
    check_engine_files,
    engine_id,
    engine_inputs,
    hash_engine_files,
    read_manifest,
    write_manifest,
)
from contract.profile import BuildProfile
from contract.target import ISA_LEVELS, Target
from pipeline.cli import main


def make_engine(d: Path) -> Path:
    """A small engine directory by hand: three files, hashed, and its manifest."""
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model": {}}\n')
    (d / "rank0.safetensors").write_bytes(b"\x01" * 1000)
    (d / "tok").mkdir()
    (d / "tok" / "vocab.json").write_text('{"a": 0}')
    files = hash_engine_files(d)
    manifest = Manifest(
        engine_id="0123456789abcdef",
        model_name="tiny",
        source=Source(uri="/ckpt/tiny", revision=None, digest="d" * 64),
        backend="eager",
        target=Target(device="cpu", arch="x86_64", isa="baseline"),
        tp=1,
        dtype="float32",
        profile=BuildProfile(),
        toolchain={"python": "3.11", "torch": "2.13"},
        files=files,
        golden={"prompt_ids": [1, 2], "tokens": [3, 4]},
    )
    write_manifest(d, manifest)
    return d


@pytest.fixture
def engine(tmp_path: Path) -> Path:
    return make_engine(tmp_path / "tiny" / "0123456789abcdef")


def _rewrite(engine: Path, data: Any) -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    (engine / "manifest.json").write_text(text)


def _refused(engine: Path) -> BuildError:
    with pytest.raises(BuildError) as info:
        read_manifest(engine)
    err = info.value
    assert "\n" not in str(err) and str(err).startswith("error: ") and " — " in str(err)
    return err


def test_round_trip_and_clean_check(engine: Path) -> None:
    m = read_manifest(engine)
    assert [f.path for f in m.files] == ["config.json", "rank0.safetensors", "tok/vocab.json"]
    assert [f.rank for f in m.files] == [None, 0, None]
    assert m.total_size == sum(p.stat().st_size for p in engine.rglob("*")
                               if p.is_file() and p.name != "manifest.json")
    assert check_engine_files(engine, m) == []


def test_the_source_format_is_recorded_only_when_set(engine: Path) -> None:
    m = read_manifest(engine)
    assert m.source.format == "" and "format" not in m.to_dict()["source"]  # older manifests
    fmt = "GGUF Q4_K_M: F32 x109, Q4_K x27, Q5_0 x81, Q6_K x9, Q8_0 x10"
    write_manifest(engine, dataclasses.replace(m, source=dataclasses.replace(m.source, format=fmt)))
    assert read_manifest(engine).source.format == fmt
    assert json.loads((engine / "manifest.json").read_text())["source"]["format"] == fmt


def test_a_weight_layout_is_recorded_and_in_the_id_only_when_not_row_major(engine: Path) -> None:
    m = read_manifest(engine)
    assert m.weight_layout == "rows" and "weight_layout" not in m.to_dict()
    panels = dataclasses.replace(m, weight_layout="panels16")
    write_manifest(engine, panels)
    assert read_manifest(engine).weight_layout == "panels16"
    assert json.loads((engine / "manifest.json").read_text())["weight_layout"] == "panels16"
    common = dict(source_digest="d" * 64, backend="aoti", tp=1, dtype="bfloat16",
                  target=Target(device="cpu", arch="x86_64", isa="avx2"),
                  profile=BuildProfile(), toolchain={})  # fmt: skip
    rows = engine_inputs(**common)
    assert engine_inputs(**common, weight_layout="rows") == rows  # older ids unchanged
    assert engine_id(engine_inputs(**common, weight_layout="panels16")) != engine_id(rows)
    ids = {engine_id(engine_inputs(**common, weight_layout=layout))
           for layout in ("rows", "panels16", "panels16q", "panels16qh", "rowsqh", "pairs16")}
    assert len(ids) == 6
    # the layout an aoti build chooses: panels where no native bf16 dot product exists
    assert [weight_layout_for("aoti", "cpu", isa) for isa in ISA_LEVELS] == [
        "rows", "panels16", "panels16", "rows", "rows"]
    # quantized engines: the integer pair panels wherever their kernels run (AVX2; AVX-512
    # with or without VNNI, the float weights in panels where no bf16 dot product exists)
    assert [weight_layout_for("aoti", "cpu", isa, quantized=True) for isa in ISA_LEVELS] == [
        "rows", "panels16qh", "panels16qh", "rowsqh", "rowsqh"]
    # bf16 engines with a bf16 dot product: float linears in pair panels (AMX's B tiles as
    # stored; vdpbf16ps passes without AMX)
    assert [weight_layout_for("aoti", "cpu", isa, dtype="bfloat16") for isa in ISA_LEVELS] == [
        "rows", "panels16", "panels16", "pairs16", "pairs16"]
    assert weight_layout_for("aoti", "cpu", "avx512_bf16", dtype="float32") == "rows"
    assert weight_layout_for("aoti", "cpu", "amx", dtype="float16") == "rows"
    assert weight_layout_for("aoti", "cpu", "amx", quantized=True, dtype="bfloat16") == "rowsqh"
    assert weight_layout_for("eager", "cpu", "avx2") == "rows"
    assert weight_layout_for("aoti", "cuda", None) == "rows"


@pytest.mark.parametrize("bad_path", [
    "/etc/passwd", "../rank0.safetensors", "tok/../../outside", "", ".", "./", "manifest.json",
])
def test_file_paths_outside_the_engine_are_refused(engine: Path, bad_path: str) -> None:
    data = json.loads((engine / "manifest.json").read_text())
    data["files"][0]["path"] = bad_path
    _rewrite(engine, data)
    err = _refused(engine)
    assert repr(bad_path) in err.cause
    assert err.exit_code == EXIT_BAD_INPUT
    with pytest.raises(ValueError, match="file path"):
        FileEntry(bad_path, None, 1, "a" * 64)


@pytest.mark.parametrize(("mutate", "expect"), [
    (lambda d: d.update(schema_version=2), "schema_version 2 is not supported"),
    (lambda d: d.update(schema_version="1"), "schema_version '1' is not supported"),
    (lambda d: d.pop("schema_version"), "schema_version None is not supported"),
    (lambda d: d.pop("files"), "bad or missing field 'files'"),
    (lambda d: d.pop("source"), "bad or missing field 'source'"),
    (lambda d: d.update(files=5), "malformed"),
    (lambda d: d.update(files=["config.json"]), "malformed"),
    (lambda d: d["files"].append(dict(d["files"][0])), "'config.json' is listed twice"),
    (lambda d: d["files"][1].update(size=-1), "size -1 is not a byte count"),
    (lambda d: d["files"][1].update(size="1000"), "size '1000' is not a byte count"),
    (lambda d: d["files"][1].update(rank="0"), "rank '0' is not a rank number"),
    (lambda d: d["files"][1].update(sha256="0" * 63), "is not a sha256 digest"),
    (lambda d: d["files"][1].update(path=7), "file path 7 is not a string"),
    (lambda d: d.update(tp=0), "tp 0 is not a positive integer"),
    (lambda d: d.update(tp="2"), "tp '2' is not a positive integer"),
    (lambda d: d.update(profile={"max_batch_size": 0}), "max_batch_size must be a positive"),
    (lambda d: d.update(toolchain=["torch"]), "malformed"),
    (lambda d: d.update(weight_layout="panels8"), "weight_layout 'panels8' is not one of"),
])
def test_bad_schema_is_refused(engine: Path, mutate: Any, expect: str) -> None:
    data = json.loads((engine / "manifest.json").read_text())
    mutate(data)
    _rewrite(engine, data)
    err = _refused(engine)
    assert expect in err.cause, err.cause


@pytest.mark.parametrize(("text", "expect"), [
    ("{", "cannot read"),
    ("", "cannot read"),
    ("[]", "is a JSON list, not an object"),
    ("null", "is a JSON NoneType, not an object"),
    ("3", "is a JSON int, not an object"),
])
def test_unparsable_manifest_is_refused(engine: Path, text: str, expect: str) -> None:
    _rewrite(engine, text)
    assert expect in _refused(engine).cause


def test_binary_manifest_is_refused(engine: Path) -> None:
    (engine / "manifest.json").write_bytes(b"\xff\xfe\x00garbage")
    assert "cannot read" in _refused(engine).cause


def test_missing_manifest_and_missing_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert "has no manifest.json, so it is not an engine" in _refused(tmp_path / "empty").cause
    assert "does not exist" in _refused(tmp_path / "nowhere").cause


def test_a_staging_directory_is_never_an_engine(engine: Path) -> None:
    """Even complete and with its manifest written, a build's .tmp-* directory is refused:
    the build may still be running, or it died before the rename that publishes it."""
    for name in (f".tmp-0123456789abcdef-{os.getpid()}-0a1b2c3d", ".tmp-0123456789abcdef-42"):
        staged = engine.parent / name
        shutil.copytree(engine, staged)
        assert check_engine_files(staged, read_manifest(engine)) == []  # the bytes are fine
        err = _refused(staged)
        assert "staging directory of a build that is running or died" in err.cause
        assert err.exit_code == EXIT_BAD_INPUT
        _refused(Path(str(staged) + "/"))  # however it is spelled
    assert read_manifest(engine).engine_id == "0123456789abcdef"


def test_check_engine_files_names_every_problem(engine: Path) -> None:
    m = read_manifest(engine)
    (engine / "config.json").unlink()  # missing
    (engine / "rank0.safetensors").write_bytes(b"\x01" * 999)  # resized
    (engine / "tok" / "vocab.json").write_text('{"b": 0}')  # same size, other bytes
    (engine / "extra.bin").write_bytes(b"x")  # not listed
    (engine / "tok" / "more.txt").write_text("y")  # not listed, in a subdirectory
    problems = dict(check_engine_files(engine, m))
    assert problems == {
        "config.json": "missing",
        "rank0.safetensors": "size 999 != 1000 in the manifest",
        "tok/vocab.json": "sha256 does not match the manifest",
        "extra.bin": "not listed in the manifest",
        "tok/more.txt": "not listed in the manifest",
    }


def test_a_listed_directory_is_missing_not_hashed(engine: Path) -> None:
    m = read_manifest(engine)
    (engine / "config.json").unlink()
    (engine / "config.json").mkdir()
    assert check_engine_files(engine, m) == [("config.json", "missing")]


def test_verify_and_inspect_refuse_in_one_line(engine: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(engine)]) == 0
    assert "ok: 3 files" in capsys.readouterr().out
    os.chmod(engine / "rank0.safetensors", 0o644)
    (engine / "rank0.safetensors").write_bytes(b"\x02" * 1000)
    assert main(["verify", str(engine)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: rank0.safetensors: sha256 does not match the manifest — "
                       "the engine is damaged; rebuild it")
    data = json.loads((engine / "manifest.json").read_text())
    data["files"][0]["path"] = "../../etc/passwd"
    _rewrite(engine, data)
    for cmd in ("verify", "inspect"):
        assert main([cmd, str(engine)]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert lines[-1].startswith("error: ") and "'../../etc/passwd' is not inside" in lines[-1]
        assert "Traceback" not in captured.err and captured.out == ""


def test_the_drafter_is_recorded_only_when_chosen(engine: Path) -> None:
    """--speculative ngram[:K] in the manifest (and in the engine id); absent otherwise, so
    engines built without it keep their manifests and ids."""
    from contract.speculative import Speculative

    m = read_manifest(engine)
    assert m.speculative is None and "speculative" not in m.to_dict()
    write_manifest(engine, dataclasses.replace(m, speculative=Speculative("ngram", 6)))
    assert read_manifest(engine).speculative == Speculative("ngram", 6)
    assert json.loads((engine / "manifest.json").read_text())["speculative"] == {
        "method": "ngram", "num_tokens": 6}
    common = dict(source_digest="d" * 64, backend="aoti", tp=1, dtype="bfloat16",
                  target=Target(device="cpu", arch="x86_64", isa="avx2"),
                  profile=BuildProfile(), toolchain={})  # fmt: skip
    plain = engine_inputs(**common)
    assert engine_inputs(**common, speculative=None) == plain
    assert engine_id(engine_inputs(**common, speculative=Speculative("ngram", 4))) != \
        engine_id(plain)
    data = json.loads((engine / "manifest.json").read_text())
    data["speculative"] = {"method": "eagle", "num_tokens": 4}
    _rewrite(engine, data)
    _refused(engine)
