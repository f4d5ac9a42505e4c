"""TensorRT-LLM's MPI next to ours: the world it sees, the finalize it needs, the leader's end.

See serve/backends/trtllm.py for why a clean exit finalizes MPI in the worker, and why ranks
other than 0 watch the leader while they block in the Executor's shutdown().
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from runtime.dist.comm import Comm
from runtime.dist.mpi import MPIRUN_ENV, loaded_libmpi, mpi_library_version, mpirun_of
from runtime.env import MPIRUN
from runtime.executors.trtllm_setup import trtllm_mpi_world
from serve.gates import GateFailure

log = logging.getLogger("serve")
FINALIZE_TIMEOUT_S = 10.0


def check_mpi_world(rank_ours: int, size_ours: int, mpirun: str | None, engine: object) -> None:
    """TensorRT-LLM's MPI world must be ours: an mpirun of another MPI than the libmpi
    TensorRT-LLM loads starts each rank as a world of its own, and the Executor would fail
    with "MPI worldSize is expected to be equal to tp*pp*cp"."""
    rank, size = trtllm_mpi_world()
    if (rank, size) == (rank_ours, size_ours):
        return
    lib = loaded_libmpi()
    version = mpi_library_version()
    library = " ".join(filter(None, (str(lib) if lib else None,
                                     f"({version})" if version else None))) or "unknown"
    launcher = mpirun or MPIRUN.raw() or _launcher_of_this_job()
    own = mpirun_of(lib) if lib is not None else None
    use = (f"start the job with the mpirun of that library: serve launch --mpirun {own} "
           f"--engine {engine} (or {MPIRUN_ENV}={own}, or `{own} -n "
           f"{size_ours} serve launch ...`)" if own is not None else
           f"start the job with the mpirun that belongs to that library (serve launch "
           f"--mpirun PATH, or {MPIRUN_ENV})")
    raise GateFailure(
        "compatible", f"TensorRT-LLM's MPI sees this process as rank {rank} of a world of "
        f"{size}, but this job is rank {rank_ours} of {size_ours}: the mpirun that "
        f"started it ({launcher or 'unknown'}) does not belong to the MPI library "
        f"TensorRT-LLM loaded ({library})", use)


def _launcher_of_this_job() -> str | None:
    """The program that started our supervisor (mpirun, or its prted/orted daemon)."""
    try:
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
        launcher = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, ppid
        return os.readlink(f"/proc/{launcher}/exe")
    except (OSError, ValueError, IndexError):
        return None


def finalize_mpi(supervisor_pid: int) -> None:
    """MPI_Finalize (bounded) when MPI is up and our supervisor still waits for us."""
    if os.getppid() != supervisor_pid or supervisor_pid <= 1:
        return  # the supervisor is gone (a drain past Open MPI's kill): nobody to hang
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        import mpi4py

        mpi4py.rc.initialize = False  # never initialize MPI just to finalize it
        from mpi4py import MPI as mpi
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return
    t = threading.Thread(target=mpi.Finalize, name="mpi-finalize", daemon=True)
    t.start()
    t.join(FINALIZE_TIMEOUT_S)
    if t.is_alive():
        log.warning("MPI_Finalize did not return within %.0f s; exiting anyway", FINALIZE_TIMEOUT_S)


def watch_leader(comm: Comm, orderly: threading.Event, exit_now: Callable[[int], None]) -> None:
    """Ranks > 0: rank 0 sends one shutdown plan before it shuts down; EOF without it means
    rank 0 died, and our shutdown() would wait for it forever."""
    try:
        plan = comm.recv_plan()
        if plan.shutdown:
            orderly.set()
            return
    except (ConnectionError, OSError, EOFError):
        pass
    if not orderly.is_set():
        log.error("lost rank 0 (the leader) before it shut down; exiting")
        exit_now(1)
