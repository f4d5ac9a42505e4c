"""A rank's cores (serve/cores.py, serve/threads.py): under a plain `mpirun -n N` Open MPI
binds each of two ranks or fewer to one core; the supervisor widens the binding to the
rank's even share of the host before the worker (and its OpenMP) starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.dist.mpi import mpi_session, mpirun_argv
from serve.cores import rank_share
from tests.conftest import REPO, subprocess_env

PROBE = Path(__file__).with_name("cores_probe.py")
HOST = sorted(os.sched_getaffinity(0))


def test_each_local_rank_gets_an_even_contiguous_share() -> None:
    host = {0, 1, 2, 3, 4, 5, 6, 7}
    assert [sorted(rank_share(host, r, 2)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [sorted(rank_share(host, r, 3)) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert rank_share({3, 9}, 0, 1) == {3, 9}
    assert rank_share({5}, 1, 2) == {5}  # more ranks than cores: at least one each
    assert [sorted(rank_share({0, 1}, r, 4)) for r in range(4)] == [[0], [1], [0], [1]]
    assert [sorted(rank_share(set(range(5)), r, 2)) for r in range(2)] == [[0, 1], [2, 3]]


def _probe(n: int, bind: str, env: dict[str, str] | None = None) -> list[dict[str, object]]:
    with mpi_session({**subprocess_env(), **(env or {})}) as e:
        done = subprocess.run([*mpirun_argv(n, bind=bind), sys.executable, str(PROBE)],
                              cwd=REPO, env=e,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])


@pytest.fixture(autouse=True)
def _two_cores_at_least() -> None:
    # The point is a rank bound to fewer cores than it could use: one core cannot show it.
    assert len(HOST) >= 2, f"this test needs 2 cores or more; the process has {HOST}"


def test_a_lone_rank_bound_to_one_core_takes_the_host() -> None:
    [rank] = _probe(1, "core")  # what a plain `mpirun -n 1` does
    assert len(rank["bound"]) == 1
    assert rank["cores"] == HOST
    plan = rank["plan"]
    assert plan["intra_op_threads"] == len(HOST) and plan["cores"] == len(HOST)
    assert plan["binding"]["from"] == rank["bound"] and plan["binding"]["to"] == HOST


def test_a_deliberate_binding_is_kept_on_request() -> None:
    [rank] = _probe(1, "core", {"AOTLLM_KEEP_BINDING": "1"})
    assert rank["cores"] == rank["bound"] and len(rank["cores"]) == 1
    assert rank["plan"]["intra_op_threads"] == 1 and "binding" not in rank["plan"]


def test_two_bound_ranks_split_the_host_without_sharing_a_core() -> None:
    ranks = _probe(2, "core")
    per = len(HOST) // 2
    assert [len(r["cores"]) for r in ranks] == [per, per]
    assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"])
    assert all(r["plan"]["intra_op_threads"] == per for r in ranks)


def test_unbound_ranks_share_the_host_by_thread_count() -> None:
    ranks = _probe(2, "none")  # our own launcher's binding
    assert all(r["cores"] == HOST and "binding" not in r["plan"] for r in ranks)
    assert all(r["plan"]["intra_op_threads"] == max(1, len(HOST) // 2) for r in ranks)


PIN_SCRIPT = """
import json, os, threading
from serve.cores import pin_compute_thread

def mask(tid):
    return os.sched_getaffinity(tid)

if os.environ.get("BOUND"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
stop = threading.Event()
before = threading.Thread(target=stop.wait)
before.start()
pinned = pin_compute_thread(1, 2)
after = threading.Thread(target=stop.wait)
after.start()
out = {"pinned": pinned, "main": sorted(mask(0)), "before": sorted(mask(before.native_id)),
       "after": sorted(mask(after.native_id))}
stop.set()
print(json.dumps(out))
"""


def _pin(bound: bool) -> dict[str, object]:
    env = {**subprocess_env(), **({"BOUND": "1"} if bound else {})}
    done = subprocess.run([sys.executable, "-c", PIN_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_step_thread_of_an_unbound_rank_is_pinned_to_its_share() -> None:
    out = _pin(bound=False)
    share = HOST[len(HOST) // 2:][:len(HOST) // 2]  # local rank 1 of 2: the upper half
    assert out["pinned"] == out["main"] == share
    assert out["after"] == share  # threads it starts later (OpenMP's) share its cores
    assert out["before"] == HOST  # a thread already running (HTTP) runs anywhere


def test_a_bound_rank_is_not_pinned_again() -> None:
    out = _pin(bound=True)
    assert out["pinned"] is None and out["main"] == out["after"] == HOST[:1]
