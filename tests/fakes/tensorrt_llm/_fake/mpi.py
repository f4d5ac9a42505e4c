"""The fake's view of MPI: rank discovery and the few collectives LEADER mode needs.

mpi4py is imported only when the process was started by an MPI launcher (or mpi4py.MPI is
already loaded), so a plain single-process test never initialises MPI. Waits poll
non-blocking requests with a sleep, because a blocking MPI wait busy-spins a core and the
ranks of a test share two.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
_TERMINATE_TAG = 0x7A11
_POLL_S = 0.002


@dataclass
class World:
    rank: int
    size: int
    comm: Any = None  # a private duplicate of COMM_WORLD once construction agreed


def world() -> World:
    if not (any(v in os.environ for v in _LAUNCHER_VARS) or "mpi4py.MPI" in sys.modules):
        return World(rank=0, size=1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return World(rank=comm.Get_rank(), size=comm.Get_size(), comm=comm)


def _wait(req: Any, timeout_s: float | None, what: str) -> Any:
    start = time.monotonic()
    while True:
        done, value = req.test()
        if done:
            return value
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise RuntimeError(
                f"fake TensorRT-LLM: {what} did not complete within {timeout_s:.0f} s "
                "(the real Executor would hang here: every rank must construct it)"
            )
        time.sleep(_POLL_S)


def agree(w: World, item: Any, timeout_s: float) -> list[Any]:
    """Collective step of construction: wait (bounded) for every rank, then allgather."""
    if w.size == 1:
        return [item]
    _wait(w.comm.Ibarrier(), timeout_s, "collective Executor construction")
    w.comm = w.comm.Dup()  # safe now: every rank is here
    return w.comm.allgather(item)


def send_terminate(w: World, leader: int) -> None:
    if w.size == 1:
        return
    reqs = [w.comm.isend(True, dest=r, tag=_TERMINATE_TAG) for r in range(w.size) if r != leader]
    for req in reqs:
        _wait(req, None, "terminate broadcast")


def wait_terminate(w: World, leader: int) -> None:
    if w.size == 1:
        return
    _wait(w.comm.irecv(source=leader, tag=_TERMINATE_TAG), None, "leader shutdown")
