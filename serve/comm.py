"""The control plane (MPI) and the data plane (a torch process group) of one TP job.

MPI launches the ranks and carries plain data: each step's plan from rank 0, barriers,
small all-gathers. The torch process group (gloo on CPU, NCCL on CUDA) carries the
collectives compiled into the model; it is bootstrapped over MPI and is the default
(world) group, whose name "0" is what the engine's compiled programs refer to.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from typing import Any

import torch.distributed as dist

from serve.plan import StepPlan

_PLAN_TAG = 17
# Workers poll for the next plan instead of blocking in MPI, which spins a core at 100%
# in Open MPI; the poll interval backs off from 50 us to 2 ms while idle.
_POLL_MIN_S, _POLL_MAX_S = 50e-6, 2e-3


class Comm:
    """MPI world of the job; size 1 without mpirun (MPI is then never initialised)."""

    def __init__(self) -> None:
        self._mpi = None
        self.rank, self.size = 0, 1
        if _launched_by_mpi():
            from mpi4py import MPI

            self._mpi = MPI.COMM_WORLD
            self.rank, self.size = self._mpi.Get_rank(), self._mpi.Get_size()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", self.rank))

    @property
    def local_size(self) -> int:
        return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", self.size))

    def allgather(self, obj: Any) -> list[Any]:
        return [obj] if self._mpi is None else self._mpi.allgather(obj)

    def bcast(self, obj: Any) -> Any:
        return obj if self._mpi is None else self._mpi.bcast(obj, root=0)

    def barrier(self) -> None:
        if self._mpi is not None:
            self._mpi.Barrier()

    def abort(self, code: int = 1) -> None:
        """Bring the whole job down (mpirun kills every rank)."""
        if self._mpi is not None:
            self._mpi.Abort(code)
        os._exit(code)

    def init_process_group(self, backend: str) -> None:
        """The torch world group over MPI: rank 0 picks a port and tells the others."""
        if self.size == 1 or dist.is_initialized():
            return
        addr = None
        if self.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        addr = self.bcast(addr)
        dist.init_process_group(backend, init_method=addr, rank=self.rank, world_size=self.size)

    def send_plan(self, plan: StepPlan) -> None:
        if self._mpi is None or self.size == 1:
            return
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        reqs = [self._mpi.Isend(data, dest=r, tag=_PLAN_TAG) for r in range(1, self.size)]
        for r in reqs:
            r.Wait()

    def recv_plan(self) -> StepPlan:
        from mpi4py import MPI

        assert self._mpi is not None
        status = MPI.Status()
        delay = _POLL_MIN_S
        while not self._mpi.Iprobe(source=0, tag=_PLAN_TAG, status=status):
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        buf = bytearray(status.Get_count(MPI.BYTE))
        self._mpi.Recv(buf, source=0, tag=_PLAN_TAG)
        return pickle.loads(buf)


def _launched_by_mpi() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
