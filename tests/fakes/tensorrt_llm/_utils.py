"""tensorrt_llm._utils: the MPI helpers (read from `tensorrt_llm/_utils.py` at 1.2.0rc2,
commit b35ac1b6; not in shared/reference). Importing the module runs a collective over
COMM_WORLD on every rank (`local_comm = mpi_comm().Split_type(OMPI_COMM_TYPE_HOST)`), so a
rank that does not import tensorrt_llm leaves the others blocked in their import."""

from __future__ import annotations

import os
from typing import Any

from ._fake import env, mpi

OMPI_COMM_TYPE_HOST = 9  # Open MPI's value; mpi4py exports only MPI_COMM_TYPE_SHARED

_world = mpi.world()
mpi.import_collective(env.collective_timeout_s())  # the real one: COMM_WORLD.Split_type
local_comm: Any = None  # the fake makes no communicator; local rank/size from the launcher


def mpi_comm() -> Any:
    """COMM_WORLD as TensorRT-LLM's libmpi sees it (None in the fake's world of one)."""
    return _world.comm


def mpi_rank() -> int:
    return _world.rank


def mpi_world_size() -> int:
    return _world.size


def global_mpi_rank() -> int:
    return _world.rank


def global_mpi_size() -> int:
    return _world.size


def local_mpi_rank() -> int:
    if _world.size == 1:
        return 0
    return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", _world.rank))


def local_mpi_size() -> int:
    if _world.size == 1:
        return 1
    return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", _world.size))
