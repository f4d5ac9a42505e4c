"""Which systems `make bench` plans, and the levels each is measured at."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common, run, systems
from bench.servers import ServerSpec, pinned


def test_quantized_systems_measure_only_their_levels() -> None:
    full = run.only_levels(run.FULL, systems.QUANT_LEVELS)
    assert (full.levels, full.requests_per_level) == ((1, 16), (3, 32))
    assert run.only_levels(run.FULL, None) is run.FULL
    quick = run.only_levels(run.QUICK, systems.QUANT_LEVELS)  # quick has levels 1 and 4
    assert (quick.levels, quick.requests_per_level) == ((1,), (2,))


def test_quantized_systems_are_built_from_the_gguf_llama_server_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AOT_LLM_CACHE", str(tmp_path))
    hf_dir = tmp_path / "SmolLM2-135M-Instruct"
    gguf = common.gguf_for(hf_dir)
    gguf.parent.mkdir(parents=True)
    q8 = systems.quant_gguf(hf_dir, "Q8_0")
    assert q8 == gguf.parent / "SmolLM2-135M-Instruct-Q8_0.gguf"
    q8.write_bytes(b"GGUF")  # Q4_0 is left missing: those systems are skipped with the reason
    built: list[list[str]] = []

    def sh(argv: list[str]) -> str:
        built.append(argv)
        return f"building...\n{tmp_path / 'engine-int8'}\n"

    planned = {p.name: p for p in systems.plan_quant(hf_dir, sh)}
    assert list(planned) == list(systems.QUANT_SYSTEMS)
    # int8_wo at TP=1 and TP=2, both from the Q8_0 file, each launched at its TP
    assert len(built) == 2 and all(b[b.index("build") + 1] == str(q8) for b in built)
    assert [(b[b.index("--quant") + 1], b[b.index("--tp") + 1]) for b in built] == [
        ("int8_wo", "1"), ("int8_wo", "2")]
    for name, tp in (("ours-tp1-int8", "1"), ("ours-tp2-int8", "2")):
        ours = planned[name].spec
        assert ours is not None and planned[name].levels == systems.QUANT_LEVELS
        assert str(tmp_path / "engine-int8") in ours.argv and ours.argv[ours.argv.index("-n") + 1] == tp
    assert planned["ours-tp1-int4"].spec is None
    assert "SmolLM2-135M-Instruct-Q4_0.gguf missing" in planned["ours-tp1-int4"].why
    # llama-server is not built in this cache: skipped with its status, not launched
    assert planned["llama-server-q8_0"].spec is None
    assert "not installed" in planned["llama-server-q8_0"].why
    # A quantized system named on --skip is neither built nor launched.
    built.clear()
    planned = {p.name: p for p in systems.plan_quant(hf_dir, sh, ["ours-tp1-int8", "ours-tp2-int8"])}
    assert built == [] and planned["ours-tp1-int8"].spec is None
    assert planned["ours-tp1-int8"].why == "skipped on the command line"


def test_spec_systems_serve_their_twins_engines_with_speculation_on() -> None:
    """`--spec`: ours-tp1-ngram serves ours-tp1's engine at TP=1 with ngram:4, at c=1 and
    c=16; a twin not measured (skipped, or its build failed) skips its speculative one too."""
    from bench.servers import ours_spec

    tp1 = ours_spec(Path("/engines/smol/tp1"), 20001, 1, "auto", "ours-tp1")
    planned = [systems.Planned("ours-tp1", tp1), systems.Planned("ours-tp2", None, "failed")]
    got = {p.name: p for p in systems.plan_spec(planned)}
    assert list(got) == list(systems.SPEC_SYSTEMS)
    spec = got["ours-tp1-ngram"].spec
    assert spec is not None and spec.name == "ours-tp1-ngram" and spec.port != tp1.port
    assert spec.argv[spec.argv.index("--engine") + 1] == "/engines/smol/tp1"
    assert spec.argv[spec.argv.index("-n") + 1] == "1"
    assert spec.argv[-2:] == ("--speculative", "ngram:4") and "--speculative" not in tp1.argv
    assert got["ours-tp1-ngram"].levels == (1, 16)
    assert got["ours-tp2-ngram"].spec is None and "ours-tp2 is not measured" in got["ours-tp2-ngram"].why
    skipped = systems.plan_spec(planned, ["ours-tp1-ngram"])[0]
    assert skipped.spec is None and skipped.why == "skipped on the command line"


def test_a_pinned_server_runs_on_its_cores_only() -> None:
    """The AIPerf cross-check confines the servers to cores the clients do not use."""
    core = min(os.sched_getaffinity(0))
    spec = pinned(ServerSpec("probe", (sys.executable, "-c",
                                       "import os; print(sorted(os.sched_getaffinity(0)))"),
                             8000, "/"), {core})
    out = subprocess.run(list(spec.argv), capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{core}]"


def test_gemma3_systems_use_the_wheels_gguf_and_gemma_s_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.resolve

    monkeypatch.setenv("AOT_LLM_CACHE", str(tmp_path))  # no llama-server installed there
    gguf = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    dequantized = tmp_path / "gemma-hf"
    monkeypatch.setattr(common, "gemma3_gguf", lambda: gguf)
    monkeypatch.setattr(pipeline.resolve, "resolve",
                        lambda src: type("R", (), {"local_dir": dequantized})())
    built: list[list[str]] = []

    def sh(argv: list[str]) -> str:
        built.append(argv)
        return f"{tmp_path / 'engine-gemma'}\n"

    planned = {p.name: p for p in systems.plan_gemma3(sh)}
    assert list(planned) == list(systems.GEMMA3_SYSTEMS)
    assert [b[b.index("build") + 1] for b in built] == [str(gguf)]
    ours = planned["ours-gemma3-tp1"]
    assert ours.spec is not None and str(tmp_path / "engine-gemma") in ours.spec.argv
    assert ours.tokenizer_dir == dequantized and ours.levels == systems.QUANT_LEVELS
    peer = planned["llama-server-gemma3"]
    assert peer.spec is None and "not installed" in peer.why
    # no GGUF at all: both are skipped with the reason, nothing is built
    monkeypatch.setattr(common, "gemma3_gguf", lambda: (_ for _ in ()).throw(
        RuntimeError("python -m demo.model --model gemma3 --gguf failed: offline")))
    assert all(p.spec is None and "offline" in p.why for p in systems.plan_gemma3(sh))
    assert len(built) == 1
