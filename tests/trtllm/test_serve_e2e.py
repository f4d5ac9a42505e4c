"""`mpirun -n 2 python -m serve launch --engine <trtllm engine>` with the contract fake on
PYTHONPATH, real HTTP and the `openai` client: tokens stream through, cancel reaches the
Executor, statistics reach /metrics, rank 0 alone enqueues while rank 1 blocks in shutdown(),
and every startup refusal is one line per rank."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from runtime.dist.mpi import mpi_session, mpirun_argv
from tests.conftest import REPO, run_mpirun
from tests.trtllm.conftest import fake_env, free_port, no_fake_env

_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank (\d)\] \w+ (.*)$")


class Server:
    def __init__(self, engine: Path, n: int, env: dict[str, str], tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.run_dir = tmp / "run"
        self.log_path = tmp / "serve.log"
        cmd = [*mpirun_argv(n), sys.executable, "-m", "serve", "launch", "--engine", str(engine),
               "--port", str(self.port), "--run-dir", str(self.run_dir), *args]
        self._log = self.log_path.open("w")
        self._session = contextlib.ExitStack()  # mpirun's session directory, while it runs
        self.proc = subprocess.Popen(cmd, env=self._session.enter_context(mpi_session(env)),
                                     cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.log()}"
            try:
                if self.get("/health/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not ready after {timeout} s:\n{self.log()}")

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()
            self._session.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        self._session.close()

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics:\n{text}")

    def lines(self) -> list[tuple[datetime, int, str]]:
        out = []
        for line in self.log().splitlines():
            m = _TS.match(line)
            if m:
                ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
                out.append((ts, int(m.group(2)), m.group(3)))
        return out


@pytest.fixture
def serving(engine_tp2: Path, tmp_path: Path) -> Iterator[Server]:
    # 20 ms per Executor iteration: a long request stays running long enough to watch.
    srv = Server(engine_tp2, 2, fake_env(FAKE_TRTLLM_ITER_DELAY_MS="20"), tmp_path,
                 "--kv-cache-tokens", "2048")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


def _expected(engine: Path, prompt: str, max_tokens: int) -> tuple[list[int], Any]:
    from tensorrt_llm._fake.toy import ToyModel
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine)
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    tokens, _ = ToyModel.from_engine_dir(engine).generate(ids, max_tokens,
                                                          end_id=tok.eos_token_id)
    return tokens, tok


def test_serve_end_to_end_under_mpirun(serving: Server, engine_tp2: Path,
                                       trtllm_fake: ModuleType) -> None:
    import openai

    srv = serving
    report = json.loads(srv.get("/v1/engine")[1])
    gates = {g["name"]: g for g in report["gates"]}
    assert all(g["state"] == "passed" for g in gates.values()), gates
    assert [r["leader"] for r in gates["kernels"]["evidence"]["ranks"]] == [True, False]
    assert gates["allocate"]["evidence"]["tokens"] == 2048
    assert gates["warmup"]["evidence"]["golden"] == "8 greedy tokens, identical"

    # 1. A request's tokens stream through to the openai client, as the engine computes them.
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    want, tok = _expected(engine_tp2, "hello world", 12)
    stream = client.completions.create(model="tiny-chat", prompt="hello world", max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2  # really streamed
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want)
    assert text == tok.decode(want, skip_special_tokens=True)

    # 2. Statistics reach /metrics while a long request runs; closing the stream cancels it.
    long = client.completions.create(model="tiny-chat", prompt="a long one", max_tokens=150,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    for got, _ in enumerate(long, 1):
        if got == 3:
            break
    assert srv.metric("llmserve_num_requests_running") == 1.0
    assert 0.0 < srv.metric("llmserve_kv_cache_usage_ratio") < 1.0
    long.close()
    deadline = time.monotonic() + 10
    while srv.metric("llmserve_num_requests_running") != 0.0:
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.1)
    sent = _wait_log(srv, r"\[rank 0\] INFO request cmpl-\w+: cancel_request\(\d+\) sent")
    done = _wait_log(srv, r"finished CANCELLED after (\d+) tokens")
    assert sent and 3 <= int(done.group(1)) < 150

    # 3. Drain rank 0 only: rank 1 gets no signal; its blocking shutdown() returns because
    # rank 0's Executor shut down, and the whole job exits 0.
    assert not (srv.run_dir / "rank1.exit").exists()  # rank 1 lived through all of the above
    os.kill(int((srv.run_dir / "rank0.pid").read_text()), signal.SIGTERM)
    assert srv.wait() == 0, srv.log()
    events = srv.lines()

    def when(rank: int, text: str) -> datetime:
        return next(ts for ts, r, msg in events if r == rank and msg.startswith(text))

    blocked = when(1, "Executor constructed (not the leader); blocking in Executor.shutdown()")
    leader_down = when(0, "Executor shut down (rank 0, the leader)")
    released = when(1, "Executor.shutdown() returned")
    assert blocked < leader_down <= released  # released only by the leader's shutdown
    assert [(srv.run_dir / f"rank{r}.exit").read_text().strip() for r in (0, 1)] == ["0", "0"]
    assert "Traceback" not in srv.log()


def test_tools_map_where_no_grammar_is_needed(serving: Server) -> None:
    """tool_choice none is plain chat on trtllm. (Calls that need a grammar go to TensorRT-LLM's
    guided decoding, tests/trtllm/test_guided.py; the generic format's prompt does not fit
    this engine's 256 tokens, so they are not driven over HTTP here.)"""
    import openai

    client = openai.OpenAI(base_url=serving.url + "/v1", api_key="unused", max_retries=0)
    tool = {"type": "function", "function": {"name": "f"}}
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="tiny-chat", messages=messages, tools=[tool],
                                         tool_choice="none", max_tokens=4, temperature=0)
    assert out.choices[0].message.tool_calls is None


def _wait_log(srv: Server, pattern: str, timeout: float = 5) -> re.Match[str]:
    """mpirun forwards the ranks' stderr asynchronously: wait for a line to arrive."""
    deadline = time.monotonic() + timeout
    while (m := re.search(pattern, srv.log())) is None:
        assert time.monotonic() < deadline, f"{pattern!r} not logged:\n{srv.log()}"
        time.sleep(0.05)
    return m


def _refused(engine: Path, n: int, env: dict[str, str], tmp: Path) -> list[str]:
    srv = Server(engine, n, env, tmp)
    try:
        rc = srv.wait(90)
    finally:
        srv.close()
    log = srv.log()
    assert rc != 0 and "Traceback" not in log, log
    errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert len(errors) == n, log  # one line per rank, the same cause
    return errors


@pytest.mark.parametrize(("case", "n", "env", "expected"), [
    ("sm", 2, {"AOTLLM_GPU_SM": "sm_89", "FAKE_TRTLLM_SM": "8.9"},
     "the engine was built for a sm_90 GPU but this GPU is sm_89"),
    ("trtllm", 2, {"FAKE_TRTLLM_VERSION": "1.2.1"},
     "the engine was built by TensorRT-LLM 1.2.0 but this host has TensorRT-LLM 1.2.1"),
    ("tensorrt", 2, {"FAKE_TENSORRT_VERSION": "10.14.1.48"},
     "the engine was built by TensorRT 10.13.0.35 but this host has TensorRT 10.14.1.48"),
    ("world", 1, {}, "the engine was built for TP=2 but mpirun started 1 rank(s)"),
])
def test_mismatch_fails_compatible_under_mpirun(engine_tp2: Path, tmp_path: Path, case: str,
                                                n: int, env: dict[str, str],
                                                expected: str) -> None:
    errors = _refused(engine_tp2, n, fake_env(**env), tmp_path)
    for line in errors:
        assert "gate compatible failed: " + expected in line, line
        assert "pipeline build" in line and "--backend trtllm" in line


def test_missing_tensorrt_llm_at_serve(engine_tp2: Path, tmp_path: Path) -> None:
    errors = _refused(engine_tp2, 2, no_fake_env(), tmp_path)
    for line in errors:
        assert "gate compatible failed: this is a TensorRT-LLM engine but TensorRT-LLM is not "\
               "installed here" in line
        assert "pip install '.[trtllm]'" in line and "NVIDIA GPU" in line


def test_launcher_of_another_mpi_fails_compatible(engine_tp2: Path, tmp_path: Path) -> None:
    """An mpirun that does not belong to TensorRT-LLM's libmpi (Open MPI 5's mpirun, Open MPI
    4.1's libmpi) starts every rank as a world of its own: the fake plays it with
    FAKE_TRTLLM_MPI=singleton. The compatible gate names the mismatch and the mpirun to use,
    instead of the Executor failing in the kernels gate with "MPI worldSize is expected..."."""
    errors = _refused(engine_tp2, 2, fake_env(FAKE_TRTLLM_MPI="singleton"), tmp_path)
    for line in errors:
        assert "gate compatible failed: TensorRT-LLM's MPI sees this process as rank 0 of a " \
               "world of 1, but this job is rank" in line, line
        assert "does not belong to the MPI library TensorRT-LLM loaded" in line
        assert "--mpirun" in line and "MPI worldSize" not in line
    assert any("this job is rank 1 of 2" in line for line in errors)


def test_rank_without_tensorrt_llm_stops_every_rank_before_any_import(
        engine_tp2: Path, tmp_path: Path) -> None:
    """`import tensorrt_llm` is an MPI collective (`_utils.py` splits COMM_WORLD): if rank 1
    cannot import it, rank 0 must not import it either, or it blocks in its import (the fake
    times out after FAKE_TRTLLM_COLLECTIVE_TIMEOUT_S where the real one hangs). The ranks agree
    over the control plane first; every rank fails the compatible gate, naming rank 1."""
    env = fake_env(FAKE_TRTLLM_COLLECTIVE_TIMEOUT_S="10")
    port = free_port()
    app = [sys.executable, "-m", "serve", "launch", "--engine", str(engine_tp2), "--port",
           str(port), "--run-dir", str(tmp_path / "run")]
    # MPMD: rank 0 with the fake on PYTHONPATH, rank 1 without it.
    args = [*app, ":", "-n", "1", "env", f"PYTHONPATH={no_fake_env()['PYTHONPATH']}", *app]
    t0 = time.monotonic()
    done = run_mpirun(1, args, env=env, timeout=120)
    log = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in log, log
    assert time.monotonic() - t0 < 60, log
    errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert len(errors) == 2, log
    rank1 = next(ln for ln in errors if "rank 1:" in ln.split("gate")[0])
    rank0 = next(ln for ln in errors if ln is not rank1)
    assert "TensorRT-LLM is not installed here" in rank1, rank1
    assert "gate compatible failed: TensorRT-LLM is not installed on rank(s) 1" in rank0, rank0
    assert "import-time MPI collective" not in log
