"""The fake's view of MPI: rank discovery and the few collectives TensorRT-LLM runs.

mpi4py is imported only when the process was started by an MPI launcher (or mpi4py.MPI is
already loaded), so a plain single-process test never initialises MPI. Waits poll
non-blocking requests with a sleep, because a blocking MPI wait busy-spins a core and the
ranks of a test share two.

What the real library does and the fake reproduces:
- `import tensorrt_llm` runs a collective on COMM_WORLD (`_utils.py`: `local_comm =
  mpi_comm().Split_type(OMPI_COMM_TYPE_HOST)`): a rank that never imports it leaves the
  others blocked inside their import (`import_collective`).
- With more than one rank, the Executor splits the session communicator into TP/CP/PP
  communicators it owns; their C++ destructor (`MpiComm::~MpiComm`, mpiUtils.cpp) calls
  MPI_Comm_free without checking whether MPI was finalized, and Open MPI aborts the process
  on any call after MPI_Finalize (`OwnedComm`). The fake is strict about it: an Executor that
  is still alive when MPI_Finalize starts is an abort, since its destructor can only run
  after Finalize (`_on_finalize`).
- A libmpi that the job's mpirun did not start (FAKE_TRTLLM_MPI=singleton) sees every process
  as rank 0 of a world of one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from . import env

_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
_TERMINATE_TAG = 0x7A11
_POLL_S = 0.002
# Open MPI's words when a handle is used after MPI_Finalize (ompi/runtime/ompi_mpi_finalize.c
# family); the process then aborts.
AFTER_FINALIZE = (
    "*** The {call}() function was called after MPI_FINALIZE was invoked.\n"
    "*** This is disallowed by the MPI standard.\n"
    "*** Your MPI job will now abort.\n"
)
ABORT_EXIT_CODE = 1


@dataclass
class World:
    rank: int
    size: int
    comm: Any = None  # a private duplicate of COMM_WORLD once construction agreed


def world() -> World:
    if env.mpi_singleton():
        return World(rank=0, size=1)  # a foreign libmpi: every process is alone
    if not (any(v in os.environ for v in _LAUNCHER_VARS) or "mpi4py.MPI" in sys.modules):
        return World(rank=0, size=1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return World(rank=comm.Get_rank(), size=comm.Get_size(), comm=comm)


def _wait(req: Any, timeout_s: float | None, what: str, why: str) -> Any:
    start = time.monotonic()
    while True:
        done, value = req.test()
        if done:
            return value
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise RuntimeError(
                f"fake TensorRT-LLM: {what} did not complete within {timeout_s:.0f} s "
                f"(the real one would hang here: {why})"
            )
        time.sleep(_POLL_S)


def import_collective(timeout_s: float) -> None:
    """`tensorrt_llm._utils` at import: COMM_WORLD.Split_type, a collective over every rank.
    The fake joins a barrier instead (it makes no communicator: Open MPI 5 allocates their
    context ids with PMIx group operations, which a rank's supervisor and worker, sharing one
    PMIx identity in this project, must not race)."""
    w = world()
    if w.size == 1:
        return
    _wait(w.comm.Ibarrier(), timeout_s,
          "the import-time MPI collective of tensorrt_llm (_utils.py: COMM_WORLD.Split_type)",
          "every rank of the job must import tensorrt_llm")


def agree(w: World, item: Any, timeout_s: float) -> list[Any]:
    """Collective step of construction: wait (bounded) for every rank, then allgather."""
    if w.size == 1:
        return [item]
    _wait(w.comm.Ibarrier(), timeout_s, "collective Executor construction",
          "every rank must construct it")
    w.comm = w.comm.Dup()  # safe now: every rank is here
    return w.comm.allgather(item)


def send_terminate(w: World, leader: int) -> None:
    if w.size == 1:
        return
    reqs = [w.comm.isend(True, dest=r, tag=_TERMINATE_TAG) for r in range(w.size) if r != leader]
    for req in reqs:
        _wait(req, None, "terminate broadcast", "")


def wait_terminate(w: World, leader: int) -> None:
    if w.size == 1:
        return
    _wait(w.comm.irecv(source=leader, tag=_TERMINATE_TAG), None, "leader shutdown", "")


# -- communicators the Executor owns (finding: MPI_Comm_free after MPI_Finalize) -----------

_LIVE: weakref.WeakSet[OwnedComm] = weakref.WeakSet()
_WATCH = threading.Lock()
_watching = False


class OwnedComm:
    """Stands for a communicator split for the Executor and freed by its destructor, as
    TensorRT-LLM's `MpiComm{split, freeComm=true}` is: freed after MPI_Finalize, the process
    aborts. No real communicator is made (see `import_collective`)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.freed = False
        _LIVE.add(self)
        _watch_finalize()

    def __del__(self) -> None:
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is None or self.freed:
            return
        if mpi.Is_finalized():
            _abort("MPI_Comm_free", f"the Executor's {self.what} communicator was destroyed")
        self.freed = True


def split_owned(w: World) -> list[OwnedComm]:
    """The Executor's TP, CP and PP communicators (executorImpl.cpp `initialize`), split from
    the session only when it has more than one rank."""
    if w.size == 1:
        return []
    return [OwnedComm(name) for name in ("tensor-parallel", "context-parallel",
                                         "pipeline-parallel")]


def _watch_finalize() -> None:
    """Run `_on_finalize` when MPI_Finalize starts (an attribute on MPI_COMM_SELF is deleted
    first thing in MPI_Finalize, MPI standard §11.2.5)."""
    global _watching
    with _WATCH:
        if _watching:
            return
        from mpi4py import MPI

        key = MPI.Comm.Create_keyval(delete_fn=_on_finalize)
        MPI.COMM_SELF.Set_attr(key, "fake-tensorrt-llm")
        _watching = True


def _on_finalize(_comm: Any, _key: Any, _value: Any) -> None:
    live = [c for c in list(_LIVE) if not c.freed]
    if live:
        _abort("MPI_Comm_free", f"MPI_Finalize started while an Executor still holds its "
               f"{live[0].what} communicator (the Executor is still referenced: its destructor, "
               "which frees them, can only run after MPI_Finalize)")


def _abort(call: str, detail: str) -> None:
    sys.stderr.write(AFTER_FINALIZE.format(call=call))
    sys.stderr.write(f"[fake TensorRT-LLM] {detail}; release the Executor (and everything "
                     "holding it) and collect before MPI_Finalize\n")
    sys.stderr.flush()
    os._exit(ABORT_EXIT_CODE)
