"""Launches of their own: SIGTERM drain, a full queue and a killed rank, failed gates.

"Every rank exits 0" is read from the run directory: the serving processes are detached
from mpirun (Open MPI 5 SIGKILLs its ranks 0.5 s after forwarding SIGTERM), and each
writes rank{N}.exit with its exit code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import threading
import time
from pathlib import Path

import openai
import pytest

from serve.backends.torch import FAULT_ENV
from serve.startup import GATE_DELAY_ENV
from tests.e2e.conftest import MODEL, Reference
from tests.e2e.harness import (
    Server,
    alive,
    assert_a_flipped_byte_fails_the_verify_gate,
    launch,
    run_to_exit,
)

DRAIN_TIMEOUT = 30.0


class Streamer(threading.Thread):
    """One streamed greedy completion on its own thread; `first` is set at the first text."""

    def __init__(self, server: Server, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.prompt, self.max_tokens = server, prompt, max_tokens
        self.first = threading.Event()
        self.text = ""
        self.finish: str | None = None
        self.completion_tokens: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.server.client().completions.create(
                model=MODEL, prompt=self.prompt, max_tokens=self.max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices:
                    self.text += chunk.choices[0].text
                    self.finish = chunk.choices[0].finish_reason or self.finish
                    self.first.set()
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
        except BaseException as e:  # reported by the test, not lost on this thread
            self.error = e
        finally:
            self.first.set()


class Completion(threading.Thread):
    """One non-streamed greedy completion on its own thread."""

    def __init__(self, srv: Server, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.prompt, self.max_tokens = srv, prompt, max_tokens
        self.text: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            out = self.srv.client(timeout=120).completions.create(
                model=MODEL, prompt=self.prompt, max_tokens=self.max_tokens, temperature=0,
                extra_body={"ignore_eos": True})
            self.text = out.choices[0].text
        except BaseException as e:
            self.error = e


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_sigterm_to_mpirun_drains_running_requests_then_every_rank_exits_0(
        engine_dir: Path, reference: Reference, tmp_path: Path) -> None:
    prompts, n = ["The quick brown fox", "Héllo wörld", "emoji 🙂 and ✓"], 150
    wants = [reference.completion(p, n, ignore_eos=True) for p in prompts]
    srv = launch(engine_dir, tmp_path, args=("--drain-timeout", str(DRAIN_TIMEOUT)))
    try:
        srv.wait_ready()
        workers = srv.worker_pids()
        streams = [Streamer(srv, p, n) for p in prompts]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(60) and s.error is None, s.error
        srv.proc.send_signal(signal.SIGTERM)  # what an orchestrator or Ctrl-C does
        signalled = time.monotonic()
        _wait_until(lambda: srv.call("GET", "/health/ready").status == 503, 5, "ready 503")
        assert srv.call("GET", "/health/ready").json()["status"] == "draining"
        with pytest.raises(openai.InternalServerError) as refused:
            srv.client().completions.create(model=MODEL, prompt="new", max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.code == "server_draining"
        assert any(s.is_alive() for s in streams), "the drain was not observed mid-generation"
        for s in streams:
            s.join(60)
        for s, want in zip(streams, wants):
            assert s.error is None, s.error
            assert (s.text, s.finish, s.completion_tokens) == (want.text, "length", n)
        codes = srv.wait_exit_codes(2, DRAIN_TIMEOUT)
        assert codes == {0: 0, 1: 0}, srv.logs()
        assert time.monotonic() - signalled < DRAIN_TIMEOUT
        srv.proc.wait(10)  # mpirun itself is gone too
        _wait_until(lambda: not any(alive(p) for p in workers), 5, "the workers to exit")
    finally:
        srv.close()


def test_full_queue_gets_429_and_kill_9_of_rank_1_brings_rank_0_down(
        engine_dir: Path, tmp_path: Path) -> None:
    srv = launch(engine_dir, tmp_path, args=("--max-queue", "1"))
    try:
        srv.wait_ready()
        long = Streamer(srv, "The quick brown fox", 240)
        long.start()
        assert long.first.wait(60) and long.error is None, long.error
        with pytest.raises(openai.RateLimitError) as full:
            srv.client().completions.create(model=MODEL, prompt="one more", max_tokens=4)
        assert full.value.code == "queue_full"
        assert int(full.value.response.headers["retry-after"]) > 0
        assert long.is_alive(), "the long request ended before the queue check"

        rank0, rank1 = srv.run_file(0, "pid"), srv.run_file(1, "pid")
        assert rank0 and rank1 and alive(rank0) and alive(rank1)
        os.kill(rank1, signal.SIGKILL)  # while rank 0 is serving the long request
        killed = time.monotonic()
        _wait_until(lambda: not alive(rank0), 10, "rank 0 to exit")
        assert srv.proc.wait(max(0.1, 10 - (time.monotonic() - killed))) != 0
        assert time.monotonic() - killed < 10
        assert srv.run_file(0, "exit") not in (None, 0), srv.logs()
        # The cause is named on stderr by whichever side mpirun hears first: the dead rank's
        # supervisor (the signal) or rank 0, whose collective the dead peer broke (the rank
        # and its host). When rank 0's exit comes first, mpirun ends the job before the
        # supervisor's line is forwarded, so either line is a correct account.
        assert re.search(r"error: rank 1: its serving process \(pid \d+\) was killed by "
                         r"SIGKILL|ERROR rank 1 on \S+: disconnected \(the process died or "
                         r"failed\)", srv.stderr()), srv.logs()
        long.join(10)
        assert not long.is_alive(), "the client of the dead job hangs"
        # Answered, not dropped: the stream ends with an error event, not a broken connection.
        assert isinstance(long.error, openai.APIError), long.error
        assert not isinstance(long.error, openai.APIConnectionError), long.error
        assert "generation failed" in str(long.error), long.error
    finally:
        srv.close()


def test_sigterm_during_start_up_ends_the_job_at_once_and_never_opens_admission(
        engine_dir: Path, tmp_path: Path) -> None:
    # Our launcher owns mpirun (a container). Liveness comes up before the warmup gate
    # (serve/rank0.py), where every rank is held (a start-up faster than the signal's way
    # to the ranks would otherwise finish first): the signal lands in start-up.
    srv = launch(engine_dir, tmp_path, prefix=(), env={GATE_DELAY_ENV: "warmup:60"})
    try:
        _wait_until(lambda: srv.probe().live == 200, 60, "liveness")
        srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        ready: list[int | None] = []
        while srv.proc.poll() is None and time.monotonic() - signalled < 10:
            ready.append(srv.probe().ready)
        assert srv.proc.wait(max(0.1, 10 - (time.monotonic() - signalled))) == 1, srv.logs()
        assert time.monotonic() - signalled < 10
        assert 200 not in ready, ready
        assert srv.wait_exit_codes(2, 5) == {0: 1, 1: 1}, srv.logs()
        rank0 = (srv.run_dir / "rank0.log").read_text()
        assert "shutdown requested before admission" in rank0, rank0[-2000:]
        assert "admission open" not in rank0
        assert "Traceback" not in srv.stderr()
    finally:
        srv.close()


def test_an_engine_fault_answers_every_request_and_ends_the_job(
        engine_dir: Path, tmp_path: Path) -> None:
    srv = launch(engine_dir, tmp_path, env={FAULT_ENV: "30"})
    try:
        srv.wait_ready()
        stream = Streamer(srv, "The quick brown fox", 150)
        plain = Completion(srv, "Héllo wörld", 150)
        stream.start()
        plain.start()
        stream.join(60)
        plain.join(60)
        # The stream had its headers out: a final SSE error event ends it.
        assert stream.text and isinstance(stream.error, openai.APIError), stream.error
        assert "fault injected at step 30" in str(stream.error)
        assert isinstance(plain.error, openai.InternalServerError), plain.error
        assert plain.error.status_code == 500 and plain.error.code == "generation_error"
        faulted = time.monotonic()
        assert srv.proc.wait(10) != 0, srv.logs()
        assert time.monotonic() - faulted < 10
        assert srv.wait_exit_codes(2, 5) == {0: 1, 1: 1}, srv.logs()
        log_lines = (srv.run_dir / "rank0.log").read_text().splitlines()
        cause = [ln for ln in log_lines if "the engine failed: RuntimeError: fault injected" in ln]
        assert len(cause) == 1 and "ERROR" in cause[0], log_lines[-10:]
        assert "Traceback" not in srv.stderr()
    finally:
        srv.close()


def test_a_flipped_byte_in_a_shard_fails_the_verify_gate_naming_the_file(
        engine_dir: Path, tmp_path: Path) -> None:
    # in the last tensor's data, not the header
    assert_a_flipped_byte_fails_the_verify_gate(engine_dir, "rank1.safetensors", -100, tmp_path)


def _writable_copy(engine_dir: Path, dst: Path) -> Path:
    shutil.copytree(engine_dir, dst)
    for p in dst.iterdir():
        p.chmod(p.stat().st_mode | stat.S_IWUSR)  # the store makes engines read-only
    return dst


@pytest.mark.parametrize("damage", ["tampered tokenizer", "unlisted config"])
def test_engine_files_are_read_only_when_the_manifest_lists_and_hashes_them(
        engine_dir: Path, tmp_path: Path, damage: str) -> None:
    engine = _writable_copy(engine_dir, tmp_path / "engine")
    if damage == "tampered tokenizer":  # e.g. a chat template or tokenizer class swapped in
        path, name = engine / "tokenizer_config.json", "tokenizer_config.json"
        path.write_text(path.read_text().replace("{", "{ ", 1))
        expected = f"{name} does not match the manifest's sha256"
    else:
        m = json.loads((engine / "manifest.json").read_text())
        m["files"] = [f for f in m["files"] if f["path"] != "config.json"]
        (engine / "manifest.json").write_text(json.dumps(m))
        expected = "config.json is not listed in the engine's manifest"
    srv, rc = run_to_exit(engine, tmp_path / "serve", n=2)
    try:
        assert rc != 0, srv.logs()
        lines = [ln for ln in srv.stderr().splitlines() if "gate resolve failed" in ln]
        assert lines and all(expected in ln for ln in lines), srv.logs()
        assert "Traceback" not in srv.stderr()
    finally:
        srv.close()


def test_world_size_other_than_tp_fails_the_compatible_gate_saying_what_to_run(
        engine_dir: Path, tmp_path: Path) -> None:
    srv, rc = run_to_exit(engine_dir, tmp_path, n=1)
    try:
        err = srv.stderr()
        assert rc != 0, srv.logs()
        assert srv.wait_exit_codes(1, 10) == {0: 1}, srv.logs()
        lines = [ln for ln in err.splitlines() if "gate compatible failed" in ln]
        assert lines, srv.logs()
        assert "TP=2" in lines[0] and "1 rank" in lines[0] and "mpirun -n 2" in lines[0], lines
        assert "Traceback" not in err
    finally:
        srv.close()
