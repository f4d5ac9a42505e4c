"""Tensor parallelism across two hosts: two network namespaces joined by a veth pair stand in
for two machines (tests/e2e/netns.py), and mpirun reaches the second through an ssh agent
that runs the command in the other namespace.

`serve launch` (our launcher, in host A) starts mpirun with `--hosts A:1,B:1`: rank 0 and
the HTTP server on A, rank 1 on B. Every address the job binds must be reachable from the
other namespace (each has its own loopback), and every failure must end the job on both
"hosts" within seconds, naming the host.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env
from tests.e2e.conftest import MODEL, Reference
from tests.e2e.harness import Server, alive
from tests.e2e.netns import ADDR_A, ADDR_B, Relay, TwoHosts, unavailable
from tests.e2e.test_serve_lifecycle import Streamer, _wait_until

WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
INNER_PORT = 8000  # rank 0's HTTP port inside host A (a namespace of its own: always free)
HOST_B = f"({ADDR_B})"  # how the messages name host B (its hostname is this machine's)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    h = TwoHosts(tmp_path_factory.mktemp("hosts"))
    try:
        yield h
    finally:
        h.close()


class TwoHostServer(Server):
    relay: Relay

    def close(self) -> None:
        super().close()
        self.relay.close()


def launch_two_hosts(hosts: TwoHosts, engine: Path, workdir: Path,
                     args: tuple[str, ...] = ()) -> TwoHostServer:
    """`ip netns exec A python -m serve launch --hosts A:1,B:1 ...`; returns at once."""
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = workdir / "run"
    out_path, err_path = workdir / "stdout.log", workdir / "stderr.log"
    cmd = [*hosts.prefix_a(), sys.executable, "-m", "serve", "launch", "--engine", str(engine),
           "--host", "127.0.0.1", "--port", str(INNER_PORT), "--run-dir", str(run_dir),
           *hosts.launch_args(), *args]
    relay = Relay(hosts.ns_a, INNER_PORT)
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    srv = TwoHostServer(proc, relay.port, run_dir, out_path, err_path, time.monotonic())
    srv.relay = relay
    return srv


def _no_job_left(srv: Server, pids: list[int], within: float) -> float:
    """Seconds until every pid is gone (asserts it happens within `within`)."""
    t0 = time.monotonic()
    _wait_until(lambda: not any(alive(p) for p in pids), within, f"{pids} to exit")
    return time.monotonic() - t0


def test_tp2_across_two_hosts_answers_like_transformers_and_drains_both(
        hosts: TwoHosts, engine_dir: Path, reference: Reference, tmp_path: Path) -> None:
    srv = launch_two_hosts(hosts, engine_dir, tmp_path, ("--drain-timeout", "60"))
    try:
        srv.wait_ready(180)
        report = srv.call("GET", "/v1/engine").json()
        topo = report["topology"]
        assert topo["hosts"] == 2, topo
        ranks = {r["rank"]: r for h in topo["by_host"] for r in h["ranks"]}
        assert (ranks[0]["addr"], ranks[0]["iface"]) == (ADDR_A, hosts.if_a), ranks
        assert (ranks[1]["addr"], ranks[1]["iface"]) == (ADDR_B, hosts.if_b), ranks
        gates = {g["name"]: g for g in report["gates"]}
        connect = gates["connect"]["evidence"]
        assert connect["collectives"] == "gloo across 2 hosts", connect
        assert [r["addr"] for r in connect["ranks"]] == [ADDR_A, ADDR_B]
        compat = gates["compatible"]["evidence"]["hosts"]
        assert [h["rank"] for h in compat] == [0, 1] and HOST_B in compat[1]["host"], compat
        assert all(h["files"] > 0 and h["torch"] for h in compat), compat

        client = srv.client()
        for prompt in ("The quick brown fox", "Héllo wörld"):
            want = reference.completion(prompt, 24)
            got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                            temperature=0)
            assert got.choices[0].text == want.text, prompt
        messages = [{"role": "user", "content": "hi there"}]
        want = reference.chat(messages, 16)
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                             temperature=0)
        assert got.choices[0].message.content == want.text

        # SIGTERM to the launcher drains the job on both hosts: streams finish, all exit 0.
        n = 120
        wants = [reference.completion(p, n, ignore_eos=True) for p in ("abc", "a cat")]
        workers = srv.worker_pids()
        assert len(workers) == 2, workers
        streams = [Streamer(srv, p, n) for p in ("abc", "a cat")]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(60) and s.error is None, s.error
        srv.proc.send_signal(signal.SIGTERM)
        _wait_until(lambda: srv.call("GET", "/health/ready").status == 503, 10, "ready 503")
        assert any(s.is_alive() for s in streams), "the drain was not observed mid-generation"
        for s, w in zip(streams, wants):
            s.join(90)
            assert s.error is None, s.error
            assert (s.text, s.finish, s.completion_tokens) == (w.text, "length", n)
        assert srv.proc.wait(60) == 0, srv.logs()
        assert srv.wait_exit_codes(2, 5) == {0: 0, 1: 0}, srv.logs()
        _no_job_left(srv, workers, 10)
    finally:
        srv.close()


def test_a_stop_signal_on_the_remote_host_drains_the_whole_job(
        hosts: TwoHosts, engine_dir: Path, reference: Reference, tmp_path: Path) -> None:
    """SIGTERM on host B (what its pod's `serve rank-host` forwards to the rank's supervisor):
    rank 1 asks rank 0 for a drain; the stream in flight finishes and both ranks exit 0."""
    srv = launch_two_hosts(hosts, engine_dir, tmp_path, ("--drain-timeout", "60"))
    try:
        srv.wait_ready(180)
        n = 120
        want = reference.completion("a cat", n, ignore_eos=True)
        stream = Streamer(srv, "a cat", n)
        stream.start()
        assert stream.first.wait(60) and stream.error is None, stream.error
        rank1 = srv.run_file(1, "pid")
        assert rank1
        supervisor = _ppid(rank1)
        os.kill(supervisor, signal.SIGTERM)
        _wait_until(lambda: srv.call("GET", "/health/ready").status == 503, 10, "ready 503")
        stream.join(90)
        assert stream.error is None, stream.error
        assert (stream.text, stream.finish) == (want.text, "length")
        assert srv.proc.wait(60) == 0, srv.logs()
        assert srv.wait_exit_codes(2, 5) == {0: 0, 1: 0}, srv.logs()
        assert "rank 1 asked for a drain" in (srv.run_dir / "rank0.log").read_text()
    finally:
        srv.close()


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def test_a_killed_remote_rank_ends_the_job_within_10_s_naming_its_host(
        hosts: TwoHosts, engine_dir: Path, tmp_path: Path) -> None:
    srv = launch_two_hosts(hosts, engine_dir, tmp_path)
    try:
        srv.wait_ready(180)
        long = Streamer(srv, "The quick brown fox", 200)
        long.start()
        assert long.first.wait(60) and long.error is None, long.error
        rank0, rank1 = srv.run_file(0, "pid"), srv.run_file(1, "pid")
        assert rank0 and rank1
        os.kill(rank1, signal.SIGKILL)  # the worker on host B
        killed = time.monotonic()
        _wait_until(lambda: not alive(rank0), 10, "rank 0 to exit")
        down = time.monotonic() - killed
        rc = srv.proc.wait(30)
        assert rc != 0, srv.logs()
        log0 = (srv.run_dir / "rank0.log").read_text()
        assert "rank 1 on" in log0 and HOST_B in log0, log0[-2000:]
        long.join(10)
        assert not long.is_alive()
        print(f"\nremote rank killed: rank 0 down after {down:.2f} s, launcher exit after "
              f"{time.monotonic() - killed:.2f} s (load {os.getloadavg()[0]:.1f})")
    finally:
        srv.close()


def test_a_host_that_drops_off_the_network_ends_the_job_within_10_s(
        hosts: TwoHosts, engine_dir: Path, tmp_path: Path) -> None:
    srv = launch_two_hosts(hosts, engine_dir, tmp_path)
    try:
        srv.wait_ready(180)
        long = Streamer(srv, "The quick brown fox", 200)
        long.start()
        assert long.first.wait(60) and long.error is None, long.error
        rank0, rank1 = srv.run_file(0, "pid"), srv.run_file(1, "pid")
        assert rank0 and rank1
        hosts.link_b(up=False)  # host B drops off the network: no FIN, no RST, silence
        cut = time.monotonic()
        _wait_until(lambda: not alive(rank0), 10, "rank 0 to exit")
        down0 = time.monotonic() - cut
        _wait_until(lambda: not alive(rank1), 15, "rank 1 (host B) to exit")
        down1 = time.monotonic() - cut
        rc = srv.proc.wait(30)  # mpirun cannot reach B: the launcher stops it
        assert rc != 0, srv.logs()
        log0 = (srv.run_dir / "rank0.log").read_text()
        lines = [ln for ln in log0.splitlines() if "rank 1 on" in ln and HOST_B in ln]
        assert lines and "stopped answering" in lines[0], log0[-2000:]
        long.join(10)
        assert not long.is_alive()
        print(f"\nhost B link down: rank 0 down after {down0:.2f} s, rank 1 after {down1:.2f} s, "
              f"launcher exit after {time.monotonic() - cut:.2f} s "
              f"(load {os.getloadavg()[0]:.1f})")
    finally:
        hosts.link_b(up=True)
        srv.close()


def test_the_launcher_killed_during_start_up_leaves_no_worker_on_either_host(
        hosts: TwoHosts, engine_dir: Path, tmp_path: Path) -> None:
    srv = launch_two_hosts(hosts, engine_dir, tmp_path)
    try:
        _wait_until(lambda: srv.run_file(0, "pid") and srv.run_file(1, "pid"), 120,
                    "both workers to start")
        workers = srv.worker_pids()
        assert len(workers) == 2
        assert srv.call("GET", "/health/ready").status != 200 if _answers(srv) else True
        os.kill(srv.proc.pid, signal.SIGKILL)  # the launcher (PID 1 of a container: all gone)
        took = _no_job_left(srv, workers, 10)
        print(f"\nlauncher killed during start-up: workers gone after {took:.2f} s")
    finally:
        srv.close()


def _answers(srv: Server) -> bool:
    try:
        srv.call("GET", "/health/live", timeout=2)
        return True
    except OSError:
        return False


def test_an_engine_missing_on_one_host_fails_the_compatible_gate_naming_that_host(
        hosts: TwoHosts, engine_dir: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(engine_dir, partial)
    os.chmod(partial, partial.stat().st_mode | stat.S_IWUSR)
    os.chmod(partial / "rank1.safetensors", stat.S_IRUSR | stat.S_IWUSR)
    (partial / "rank1.safetensors").unlink()  # host B's copy lost its shard
    hosts.hide_on_b(partial, engine_dir)
    try:
        srv = launch_two_hosts(hosts, engine_dir, tmp_path / "serve")
        try:
            rc = srv.proc.wait(120)
            assert rc != 0, srv.logs()
            err = srv.stderr()
            lines = [ln for ln in err.splitlines() if "gate compatible failed" in ln and
                     "rank 1 on" in ln]
            assert lines and HOST_B in lines[0] and "rank1.safetensors" in lines[0], srv.logs()
            assert "Traceback" not in err
        finally:
            srv.close()
    finally:
        hosts.clear_mounts()


def test_an_interface_that_does_not_exist_is_refused_naming_the_host(
        hosts: TwoHosts, engine_dir: Path, tmp_path: Path) -> None:
    srv = launch_two_hosts(hosts, engine_dir, tmp_path, ("--comm-iface", "nosuch0"))
    try:
        rc = srv.proc.wait(60)
        assert rc != 0
        err = srv.stderr()
        assert "no interface of host" in err and "nosuch0" in err and hosts.if_a in err, err
    finally:
        srv.close()
