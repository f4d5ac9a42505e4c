"""`pipeline build --backend trtllm` end to end with the contract fake on PYTHONPATH."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from contract.manifest import check_engine_files, read_manifest
from contract.profile import BuildProfile
from pipeline.build import plan_build
from pipeline.config import BuildConfig
from tests.conftest import make_tiny_checkpoint
from tests.trtllm.conftest import PROFILE_ARGS


def test_engine_has_trtllm_layout_and_our_manifest(engine_tp2: Path, chat_ckpt: Path,
                                                   trtllm_fake: ModuleType) -> None:
    files = {p.name for p in engine_tp2.iterdir()}
    # TensorRT-LLM's own layout (config.json + rank{N}.engine), ours beside it.
    assert {"config.json", "rank0.engine", "rank1.engine", "model_config.json",
            "manifest.json", "tokenizer.json"} <= files
    assert not any(f.endswith(".safetensors") for f in files) and ".golden.json" not in files
    assert not (engine_tp2 / ".trtllm-checkpoint").exists()
    trt_cfg = json.loads((engine_tp2 / "config.json").read_text())
    assert {"version", "pretrained_config", "build_config"} <= trt_cfg.keys()
    assert trt_cfg["pretrained_config"]["mapping"]["tp_size"] == 2
    bc = trt_cfg["build_config"]
    assert (bc["max_batch_size"], bc["max_num_tokens"], bc["max_seq_len"],
            bc["max_input_len"]) == (4, 128, 256, 255)
    assert bc["kv_cache_type"].lower() == "paged"
    plugins = bc["plugin_config"]
    assert plugins["gemm_plugin"] == "auto" and plugins["use_paged_context_fmha"]
    assert plugins["multiple_profiles"] and plugins["tokens_per_block"] == 16
    ours = json.loads((engine_tp2 / "model_config.json").read_text())
    assert ours["model"]["vocab_size"] == json.loads((chat_ckpt / "config.json").read_text())[
        "vocab_size"]

    m = read_manifest(engine_tp2)
    assert (m.backend, m.tp, m.target.device, m.target.sm) == ("trtllm", 2, "cuda", "sm_90")
    assert m.toolchain["tensorrt_llm"] == "1.2.0" and m.toolchain["tensorrt"] == "10.13.0.35"
    assert {f.path: f.rank for f in m.files}["rank1.engine"] == 1
    assert check_engine_files(engine_tp2, read_manifest(engine_tp2)) == []  # all listed, hashed

    # The golden record came from running the built engine: the toy rule predicts it.
    from tensorrt_llm._fake.toy import ToyModel

    g = m.golden
    toy = ToyModel.from_engine_dir(engine_tp2)
    want, _ = toy.generate(g["prompt_token_ids"], len(g["tokens"]))
    assert g["kind"] == "tokens" and g["tokens"] == want and len(want) == 8


def test_rebuild_is_a_cache_hit_and_versions_key_the_engine(
        engine_tp2: Path, chat_ckpt: Path, trtllm_fake: ModuleType, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    store = engine_tp2.parents[1]
    rc, out, err = _cli(capsys, chat_ckpt, "--tp", "2", "--target", "sm_90", "--store", store)
    assert rc == 0 and "cache hit" in out, err
    assert Path(out.strip().splitlines()[-1]) == engine_tp2
    cfg = BuildConfig(model=str(chat_ckpt), tp=2, backend="trtllm", target="sm_90",
                      profile=BuildProfile(max_batch_size=4, max_num_tokens=128, max_seq_len=256),
                      store=str(store))
    assert plan_build(cfg).engine_id == engine_tp2.name
    from tests.trtllm.conftest import helper

    # The build reads the versions from the installed distributions, as pip records them.
    for module, value in (("tensorrt_llm", "1.2.1"), ("tensorrt", "10.14.1")):
        with monkeypatch.context() as mp:
            mp.syspath_prepend(str(helper.write_dists(tmp_path / module, {module: value})))
            plan = plan_build(cfg)
            assert plan.toolchain[module] == value and plan.engine_id != engine_tp2.name, module


def _cli(capsys: pytest.CaptureFixture[str], ckpt: Path, *args: object) -> tuple[int, str, str]:
    """`pipeline build CKPT --backend trtllm ...` in this process: (exit code, stdout, stderr)."""
    from pipeline.cli import main

    capsys.readouterr()
    rc = main(["build", str(ckpt), "--backend", "trtllm", *PROFILE_ARGS, *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1, stderr
    return lines[-1]


def test_missing_tensorrt_llm_is_one_line(chat_ckpt: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ImportError):
        import tensorrt_llm  # noqa: F401  (the fake is not on sys.path outside its fixture)
    rc, out, err = _cli(capsys, chat_ckpt, "--tp", "1", "--target", "sm_90",
                        "--store", tmp_path / "engines")
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert "TensorRT-LLM 1.2.x" in line and "not installed" in line
    assert "pip install .[trtllm]" in line and "NVIDIA GPU" in line


@pytest.mark.parametrize(("args", "env", "expected"), [
    (("--target", "cpu"), {}, "TensorRT-LLM engines run on NVIDIA GPUs only"),
    (("--target", "sm_90"), {"AOTLLM_GPU_SM": "8.9"},
     "--target sm_90 was requested but this host's GPU is sm_89"),
    ((), {}, "cannot tell this host's GPU SM"),
])
def test_bad_target_is_one_line(chat_ckpt: Path, tmp_path: Path, trtllm_fake: ModuleType,
                                monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                                env: dict[str, str], expected: str) -> None:
    monkeypatch.delenv("AOTLLM_GPU_SM", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, out, err = _cli(capsys, chat_ckpt, "--tp", "1", *args, "--store", tmp_path / "engines")
    assert rc == 2 and out == ""
    assert expected in _one_error_line(err)
    assert not (tmp_path / "engines").exists()


def test_non_llama_checkpoint_is_refused(tmp_path: Path, trtllm_fake: ModuleType,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "qwen", "qwen2")
    rc, _, err = _cli(capsys, ckpt, "--tp", "1", "--target", "sm_90", "--store", tmp_path / "e")
    assert rc == 2
    assert "converts Llama-family checkpoints only" in _one_error_line(err)


@pytest.fixture
def fake_in_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fake reachable as an install is, from this process and its children: its
    metadata on sys.path here, the package on the children's PYTHONPATH, never imported here.
    Yields the FAKE_TRTLLM_TRACE file the fake appends its imports and checkpoint saves to."""
    from tests.trtllm.conftest import FAKES, fake_env, helper

    trace = tmp_path / "fake-trace.jsonl"
    for key, value in helper.DEFAULT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAKE_TRTLLM_TRACE", str(trace))
    monkeypatch.setenv("PYTHONPATH", fake_env()["PYTHONPATH"])
    helper.purge_fake_modules()
    monkeypatch.syspath_prepend(str(FAKES))
    yield trace
    helper.purge_fake_modules()


def _trace(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def test_kernels_are_timed_once_and_nothing_lands_outside_the_engine(
        chat_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        fake_in_children: Path) -> None:
    """TensorRT's timing cache lives in the staging directory: rank 0 times the kernels, rank 1
    reuses the timings, and neither `model.cache` (BuildConfig's default, relative to the
    working directory) nor a checkpoint nobody reads is written anywhere. The build runs in a
    child, so the fake reports its checkpoint saves through FAKE_TRTLLM_TRACE."""
    from pipeline.build import build_engine

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cfg = BuildConfig(model=str(chat_ckpt), tp=2, backend="trtllm", target="sm_90",
                      profile=BuildProfile(max_batch_size=2, max_num_tokens=64, max_seq_len=128),
                      store=str(tmp_path / "store"))
    engine = build_engine(cfg).engine_dir
    from tensorrt_llm._fake.engine_file import read_engine_file  # after the build: a reader

    timed = [read_engine_file(engine / f"rank{r}.engine")["kernels_timed"] for r in (0, 1)]
    assert timed == [True, False]  # rank 1 was built from rank 0's timing cache
    events = _trace(fake_in_children)
    assert any(e["event"] == "import" for e in events)  # the trace works: the child imported
    assert [e for e in events if e["event"] == "save_checkpoint"] == []  # built in memory
    assert list(cwd.iterdir()) == []  # no model.cache in the working directory
    listed = {f.path for f in read_manifest(engine).files}
    assert not any("cache" in p or "checkpoint" in p for p in listed), listed
    assert {p.name for p in engine.iterdir()} >= {"rank0.engine", "rank1.engine"}
    assert not any(p.name.startswith(".") for p in engine.iterdir())


def test_the_build_process_never_imports_tensorrt_llm(
        chat_ckpt: Path, tmp_path: Path, fake_in_children: Path) -> None:
    """Importing tensorrt_llm initialises MPI (`_utils.py`), and a build that had done so would
    start the golden run's `mpirun` as an MPI singleton. The build reads the versions from the
    distributions' metadata and converts and builds in a child: in this process neither
    tensorrt_llm nor tensorrt is imported, though both are importable here."""
    import importlib.util
    import os
    import sys

    from pipeline.build import build_engine

    assert importlib.util.find_spec("tensorrt_llm") is not None  # it could have imported it
    cfg = BuildConfig(model=str(chat_ckpt), tp=2, backend="trtllm", target="sm_90",
                      profile=BuildProfile(max_batch_size=2, max_num_tokens=64, max_seq_len=128),
                      store=str(tmp_path / "store"))
    result = build_engine(cfg)
    assert not result.cache_hit
    assert not [m for m in sys.modules if m.split(".")[0] in ("tensorrt_llm", "tensorrt")]
    imports = [e for e in _trace(fake_in_children) if e["event"] == "import"]
    assert imports and os.getpid() not in {e["pid"] for e in imports}
    by_child = {next(k for k in ("trtllm_build", "trtllm_golden") if k in " ".join(e["argv"])):
                e["mpi"] for e in imports}
    # The conversion child is the MPI singleton now; the golden run's ranks are mpirun's job.
    assert by_child == {"trtllm_build": "singleton", "trtllm_golden": "job"}, imports
    m = result.manifest  # the versions came from the metadata, and agree with the module's
    assert (m.toolchain["tensorrt_llm"], m.toolchain["tensorrt"]) == ("1.2.0", "10.13.0.35")


@pytest.mark.parametrize("case", ["tensorrt_llm raises", "child cannot import it", "child dies"])
def test_a_failing_build_child_is_one_line(
        chat_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], fake_in_children: Path, case: str) -> None:
    """What goes wrong in the build child reaches the user as one line with a remedy: the
    child's own cause when TensorRT-LLM raised, or the last thing it printed when it could not
    even start; the child's whole output is kept in a log the line names."""
    from tests.trtllm.conftest import no_fake_env

    if case == "tensorrt_llm raises":  # the planner's SM passes; the GPU TensorRT sees fails
        monkeypatch.setenv("FAKE_TRTLLM_SM", "8.6")
        args: tuple[str, ...] = ("--quant", "fp8")
        expected = "TensorRT-LLM failed to build the engine: RuntimeError: FP8 quantization"
    elif case == "child cannot import it":  # metadata found, the package broken
        monkeypatch.setenv("PYTHONPATH", no_fake_env()["PYTHONPATH"])
        args = ()
        expected = "cannot import TensorRT-LLM (No module named 'tensorrt_llm')"
    else:  # a crash in native code: no event, a signal, a last line on stderr
        import sys

        crash = tmp_path / "crashing-python"
        crash.write_text("#!/bin/sh\necho '[TRT] [E] 1: [defaultAllocator.cpp::allocate] "
                         "out of memory' >&2\nkill -SEGV $$\n")
        crash.chmod(0o755)
        monkeypatch.setattr(sys, "executable", str(crash))
        args = ()
        expected = "was killed by SIGSEGV: [TRT] [E] 1: [defaultAllocator.cpp::allocate] out of"
    rc, out, err = _cli(capsys, chat_ckpt, "--tp", "1", "--target", "sm_90", *args,
                        "--store", tmp_path / "engines")
    assert rc == 1 and out == "", err
    line = _one_error_line(err)
    assert expected in line, line
    log = Path(line.rsplit("TensorRT-LLM's full output is in ", 1)[1])
    assert log.is_file()
    log.unlink()
    assert not [p for p in (tmp_path / "engines").rglob("*") if p.is_file()]


def test_trtllm_extra_lets_tensorrt_llm_choose_its_tensorrt() -> None:
    """1.2.1 needs TensorRT 10.14 where 1.2.0rc2 pinned 10.13: a TensorRT pin of ours beside
    `tensorrt_llm==1.2.*` makes pip refuse (or pick an older 1.2.x). The installed versions are
    recorded in the manifest and checked by the compatible gate instead."""
    import tomllib

    from tests.conftest import REPO

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["trtllm"]
    assert extras == ["tensorrt_llm==1.2.*"]


def test_plugin_config_auto_reads_back_as_the_dtype_and_the_build_takes_it(
        trtllm_fake: ModuleType, tmp_path: Path) -> None:
    """The real PluginConfig returns its dtype for a field set to "auto" (plugin.py); reading
    back gemm_plugin="auto" as a mismatch stopped every non-fp8 build."""
    from tensorrt_llm.plugin import PluginConfig

    from pipeline.compile.trtllm import make_build_config

    pc = PluginConfig(gemm_plugin="auto", dtype="bfloat16")
    assert pc.gemm_plugin == "bfloat16" and pc.model_dump()["gemm_plugin"] == "auto"
    bc = make_build_config(BuildProfile(max_batch_size=4, max_num_tokens=128, max_seq_len=256),
                           tmp_path / "timing.cache")
    assert bc.plugin_config.model_dump()["gemm_plugin"] == "auto"
    assert bc.plugin_config.multiple_profiles and bc.plugin_config.tokens_per_block == 16


def test_a_golden_run_that_hangs_fails_the_build_naming_the_stage(
        engine_tp1: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The golden run is a child process (under mpirun at TP > 1): one that does not finish is
    killed after AOTLLM_GOLDEN_TIMEOUT_S and the build says which stage hung."""
    import shutil
    import time

    from contract.errors import BuildError
    from pipeline.compile.trtllm import compute_golden
    from tests.trtllm.conftest import fake_env

    engine = tmp_path / "engine"
    shutil.copytree(engine_tp1, engine)
    for p in [engine, *engine.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    monkeypatch.setenv("PYTHONPATH", fake_env()["PYTHONPATH"])
    monkeypatch.setenv("FAKE_TRTLLM_ITER_DELAY_MS", "3000")  # 8 tokens: ~24 s
    monkeypatch.setenv("AOTLLM_GOLDEN_TIMEOUT_S", "2")
    t0 = time.monotonic()
    with pytest.raises(BuildError) as info:
        compute_golden(engine, 1, "float32")
    assert time.monotonic() - t0 < 15
    assert "stage golden" in str(info.value) and "did not finish within 2 s" in str(info.value)
    assert not (engine / ".golden.json").exists()
