"""One rank of the exit-crash regression test: collectives in flight, then exit.

    mpirun -n 2 python -m tests.runtime.mpi_exit_worker

Async all-reduces leave tensors referenced by gloo's worker threads; exiting through the
interpreter's finalization while they are released aborted one process in five.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.dist.comm import Comm, finish


def main() -> Comm:
    comm = Comm.from_mpi()
    comm.init_process_group("gloo")
    works = []
    for i in range(40):
        t = torch.full((576,), float(comm.rank + i))
        dist.all_reduce(t)
        works.append(dist.all_reduce(torch.ones(64), async_op=True))
    for w in works:
        w.wait()
    return comm


if __name__ == "__main__":
    finish(0, main())
