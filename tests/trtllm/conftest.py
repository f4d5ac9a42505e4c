"""TensorRT-LLM backend tests: everything runs against the contract fake (tests/fakes), never a
real TensorRT-LLM. The fake is importable only through the `trtllm_fake` fixture (in this
process) or `fake_env()` (in a child process)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, make_served_checkpoint
from tests.conftest import subprocess_env as repo_env

FAKES = REPO / "tests" / "fakes"
_spec = importlib.util.spec_from_file_location("trtllm_fake_helper", FAKES / "conftest_helper.py")
assert _spec is not None and _spec.loader is not None
helper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helper)
trtllm_fake = helper.trtllm_fake  # the fixture: `tensorrt_llm` is the fake inside the test

def _host_reason() -> str | None:
    """These tests play a CPU-only host where TensorRT-LLM is absent and the fake stands in."""
    import importlib.util as iu

    import torch

    if iu.find_spec("tensorrt_llm") is not None:
        return "a real tensorrt_llm is installed (the missing-package checks need it absent)"
    if torch.cuda.is_available():
        return "torch sees a GPU (the tests fix the GPU SM through the fake and AOTLLM_GPU_SM)"
    return None


@pytest.fixture(autouse=True, scope="session")
def _cpu_only_host() -> None:
    reason = _host_reason()
    if reason is not None:
        pytest.skip(f"contract-fake tests: {reason}")
    os.environ.pop("AOTLLM_GPU_SM", None)  # each test that wants a GPU SM sets its own


# Small, so warmup and the KV cache stay tiny; max_num_tokens < max_seq_len on purpose.
PROFILE_ARGS = ("--max-batch-size", "4", "--max-num-tokens", "128", "--max-seq-len", "256")


def fake_env(**extra: str) -> dict[str, str]:
    """A child's environment: this repo and the fake on PYTHONPATH, the fake's defaults, then
    `extra` (FAKE_*_VERSION there changes the fake's distribution metadata too)."""
    base = repo_env()
    base.pop("AOTLLM_GPU_SM", None)
    base.update(extra)
    return helper.subprocess_env(base)


def no_fake_env() -> dict[str, str]:
    """A child's environment without the fake: `import tensorrt_llm` fails there."""
    env = repo_env()
    parts = [p for p in env["PYTHONPATH"].split(os.pathsep) if p and Path(p) != FAKES]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def pipeline_build(ckpt: Path, store: Path, tp: int, *extra: str,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipeline", "build", str(ckpt), "--backend", "trtllm",
           "--tp", str(tp), "--store", str(store), *PROFILE_ARGS, *extra]
    return subprocess.run(cmd, env=env or fake_env(), capture_output=True, text=True,
                          timeout=180, cwd=REPO)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_served_checkpoint(tmp_path_factory.mktemp("trtllm-ckpt") / "tiny-chat")


@pytest.fixture(scope="session")
def engine_tp2(chat_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once by the real CLI with the fake: `pipeline build ... --tp 2 --target sm_90`."""
    store = tmp_path_factory.mktemp("trtllm-store")
    done = pipeline_build(chat_ckpt, store, 2, "--target", "sm_90")
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def engine_tp1(chat_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built by build_engine in this process, TP=1: the fake's metadata on sys.path, the fake
    itself imported only by the build's children (conversion and build, golden run)."""
    from contract.profile import BuildProfile
    from pipeline.build import build_engine
    from pipeline.config import BuildConfig

    store = tmp_path_factory.mktemp("trtllm-store1")
    profile = BuildProfile(max_batch_size=4, max_num_tokens=128, max_seq_len=256)
    cfg = BuildConfig(model=str(chat_ckpt), tp=1, backend="trtllm", target="sm_90",
                      profile=profile, store=str(store))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in helper.DEFAULT_ENV.items():
            mp.setenv(key, value)
        mp.setenv("PYTHONPATH", fake_env()["PYTHONPATH"])  # the build's children
        helper.purge_fake_modules()
        mp.syspath_prepend(str(FAKES))
        try:
            return build_engine(cfg).engine_dir
        finally:
            helper.purge_fake_modules()
