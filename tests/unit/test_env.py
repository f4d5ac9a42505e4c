"""The environment-variable registry (runtime/env.py) against the source and the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runtime import env

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("contract", "runtime", "pipeline", "serve", "bench", "demo", "deploy", "tests")
# Our prefixes; the word boundary keeps FAKE_TRTLLM_SM (the tests' fake) out.
NAME = re.compile(r"\b(?:AOTLLM|AOT_LLM)_[A-Z0-9_]*[A-Z0-9]")
DESIGN = REPO / "docs" / "design.md"


def _named_in_source() -> dict[str, str]:
    """Every variable name of ours the source, the Makefile and the README mention, with a
    file that does."""
    files = [p for top in SOURCES for p in (REPO / top).rglob("*")
             if p.is_file() and p.suffix in (".py", ".sh", ".md", ".toml", ".yaml", ".yml", "")]
    files += [REPO / "Makefile", REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found: dict[str, str] = {}
    for path in files:
        if "results" in path.parts:  # bench/results: recorded runs, not code
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for name in NAME.findall(text):
            found.setdefault(name, str(path.relative_to(REPO)))
    return found


def test_every_variable_the_source_names_is_registered() -> None:
    registered = {v.name for v in env.REGISTRY}
    missing = {n: where for n, where in _named_in_source().items() if n not in registered}
    assert not missing, f"not in runtime/env.py's REGISTRY: {missing}"


def test_registry_entries_are_unique_and_named_in_the_source() -> None:
    names = [v.name for v in env.REGISTRY]
    assert len(names) == len(set(names))
    # An entry nothing reads any more is stale: its name then appears only in runtime/env.py
    # and the docs. (BENCH_HF_DIR has its own prefix: bench/common.py reads it.)
    named = _named_in_source()
    stale = [v.name for v in env.REGISTRY
             if v.name.startswith(("AOTLLM_", "AOT_LLM_")) and v.name not in named]
    assert not stale, stale


def test_the_design_documents_the_registry() -> None:
    """docs/design.md's table is `markdown_table()`'s, verbatim."""
    assert env.markdown_table() in DESIGN.read_text(), (
        "docs/design.md §8 differs from the registry: paste the output of `python -c "
        "'from runtime.env import markdown_table; print(markdown_table())'`")


def test_contract_reads_no_environment() -> None:
    reads = re.compile(r"\bos\.(?:environ|getenv|putenv)\b|\bfrom os import .*\b(?:environ|getenv)")
    for path in (REPO / "contract").rglob("*.py"):
        assert not reads.search(path.read_text()), path


def test_only_runtime_env_reads_our_variables() -> None:
    """Modules read our variables through the registry: a literal name beside an environ
    read means a variable bypassing it."""
    direct = re.compile(r"(?:environ\.get|getenv)\(\s*[\"'](?:AOTLLM|AOT_LLM)_")
    for top in ("contract", "runtime", "pipeline", "serve", "bench", "demo"):
        for path in (REPO / top).rglob("*.py"):
            assert not direct.search(path.read_text()), path


def test_accessors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.GC_FREEZE.name, raising=False)
    assert env.flag(env.GC_FREEZE)  # default on
    monkeypatch.setenv(env.GC_FREEZE.name, "0")
    assert not env.flag(env.GC_FREEZE)
    monkeypatch.delenv(env.KEEP_BINDING.name, raising=False)
    assert not env.flag(env.KEEP_BINDING)  # default off
    monkeypatch.setenv(env.KEEP_BINDING.name, "1")
    assert env.flag(env.KEEP_BINDING)
    monkeypatch.setenv(env.STORE_DEADLINE.name, " ")  # blank is unset
    assert env.number(env.STORE_DEADLINE) == 30.0
    monkeypatch.setenv(env.STORE_DEADLINE.name, "soon")
    with pytest.raises(ValueError, match="AOTLLM_STORE_DEADLINE_S='soon'"):
        env.number(env.STORE_DEADLINE)
    with pytest.raises(ValueError, match="no default"):
        env.number(env.API_KEY)
    monkeypatch.setenv(env.CACHE.name, "/tmp/c")
    assert env.cache_root() == Path("/tmp/c")


def test_defaults_match_the_code_that_falls_back() -> None:
    """The modules that keep their own default constant agree with the registry's."""
    from runtime.dist import bootstrap
    from runtime.store import objstore

    assert float(env.STORE_DEADLINE.default or "nan") == objstore.DEFAULT_DEADLINE_S
    assert env.PEER_TIMEOUT.default == "4" and isinstance(bootstrap.PEER_TIMEOUT_S, float)
    src = (REPO / "pipeline" / "compile" / "trtllm.py").read_text()
    golden = re.search(r"^GOLDEN_TIMEOUT_S = ([0-9.]+)$", src, re.M)
    assert golden and float(golden.group(1)) == float(env.GOLDEN_TIMEOUT.default or "nan")
