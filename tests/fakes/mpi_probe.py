"""Run under `mpirun -n N` by tests/unit/test_trtllm_fake.py to check LEADER-mode rules.

    python mpi_probe.py <engine_dir> <out_dir> <scenario>

scenario "leader": every rank constructs the Executor; rank 0 generates, waits, then shuts
down; other ranks try the leader-only calls (expecting errors) and then block in shutdown().
scenario "missing": rank 1 never constructs; rank 0's construction must fail, not hang.
scenario "import": rank 1 never imports tensorrt_llm; rank 0's import (an MPI collective)
fails after FAKE_TRTLLM_COLLECTIVE_TIMEOUT_S where the real one hangs.
scenario "world": what tensorrt_llm._utils says the MPI world is.
scenarios "finalize-alive" / "finalize-released": every rank constructs and shuts down, then
MPI_Finalize runs with the Executor still referenced (the process aborts, as Open MPI does
when the Executor's communicators are freed after it) or after releasing it (a clean exit).
Each rank writes <out_dir>/rank{N}.json (before finalizing, in the finalize scenarios).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from mpi4py import MPI


def _error(fn: Any) -> str | None:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def leader(engine_dir: str) -> dict[str, Any]:
    from tensorrt_llm.bindings import executor as trtllm

    rank = MPI.COMM_WORLD.Get_rank()
    ex = trtllm.Executor(engine_dir, trtllm.ModelType.DECODER_ONLY, trtllm.ExecutorConfig())
    out: dict[str, Any] = {"can_enqueue": ex.can_enqueue_requests()}
    if rank == 0:
        rid = ex.enqueue_request(trtllm.Request([1, 2, 3], 4))
        out["tokens"] = ex.await_responses(rid, timeout=timedelta(seconds=10))[
            0
        ].result.output_token_ids[0]
        time.sleep(0.5)  # the worker reaches shutdown() well before this rank calls it
        out["shutdown_called"] = time.time()
        ex.shutdown()
    else:
        out["enqueue_error"] = _error(lambda: ex.enqueue_request(trtllm.Request([1], 1)))
        out["await_error"] = _error(lambda: ex.await_responses(timeout=timedelta(seconds=0)))
        out["cancel_error"] = _error(lambda: ex.cancel_request(1))
        out["stats_error"] = _error(ex.get_latest_iteration_stats)
        ex.shutdown()  # blocks until the leader shuts down
        out["shutdown_returned"] = time.time()
    return out


def missing(engine_dir: str) -> dict[str, Any]:
    from tensorrt_llm.bindings import executor as trtllm

    if MPI.COMM_WORLD.Get_rank() != 0:
        time.sleep(2.5)  # outlive rank 0's 1 s construction timeout
        return {"constructed": False}
    cfg = trtllm.ExecutorConfig()
    err = _error(lambda: trtllm.Executor(engine_dir, trtllm.ModelType.DECODER_ONLY, cfg))
    return {"construct_error": err}


def import_only_on_rank0(_engine_dir: str) -> dict[str, Any]:
    if MPI.COMM_WORLD.Get_rank() != 0:
        time.sleep(2.5)  # outlive rank 0's 1 s collective timeout
        return {"imported": False}
    try:
        import tensorrt_llm  # noqa: F401
    except RuntimeError as e:
        return {"import_error": str(e)}
    return {"imported": True}


def world(_engine_dir: str) -> dict[str, Any]:
    from tensorrt_llm import _utils

    return {"rank": _utils.mpi_rank(), "size": _utils.mpi_world_size(),
            "mpi4py_size": MPI.COMM_WORLD.Get_size()}


_KEEP: list[Any] = []


def finalize(engine_dir: str, release: bool) -> dict[str, Any]:
    from tensorrt_llm.bindings import executor as trtllm

    ex = trtllm.Executor(engine_dir, trtllm.ModelType.DECODER_ONLY, trtllm.ExecutorConfig())
    ex.shutdown()  # the leader's releases the others
    if not release:
        _KEEP.append(ex)  # still referenced when MPI_Finalize starts
    del ex
    gc.collect()
    return {"released": release}


def main() -> None:
    engine_dir, out_dir, scenario = sys.argv[1:4]
    rank = MPI.COMM_WORLD.Get_rank()
    scenarios = {
        "leader": leader, "missing": missing, "import": import_only_on_rank0, "world": world,
        "finalize-alive": lambda d: finalize(d, release=False),
        "finalize-released": lambda d: finalize(d, release=True),
    }
    try:
        result = scenarios[scenario](engine_dir)
    except RuntimeError as e:
        result = {"error": str(e)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if scenario.startswith("finalize"):
        MPI.Finalize()


if __name__ == "__main__":
    main()
