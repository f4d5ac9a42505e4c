"""Run under `mpirun -n N`: load built engines with the runtime and record their logits.

Usage: mpi_engine_worker.py OUT.json ENGINE_DIR [ENGINE_DIR ...]. Each engine runs the same
mixed step sequence (two prefills, then two decodes beside a new prefill); rank 0 writes
the logits of every engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from contract.manifest import read_manifest
from runtime.core.plan import NewSeq, ScheduledSeq, StepPlan
from runtime.dist.comm import Comm, finish
from runtime.executors.torch import runner_from_engine
from runtime.models.parallel import TPContext
from runtime.store.files import EngineFiles

A, B, C = [1, 5, 9, 33, 7, 100, 3], [4, 8, 15, 16, 23, 42, 99, 12, 13, 14, 1], [7, 7, 7, 1, 2]
REFERENCE_TOKENS = [A, B, [*A, 50], C, [*B, 60]]


def plans(bs: int) -> list[StepPlan]:
    blocks = lambda n, first: list(range(first, first + (n + bs - 1) // bs))  # noqa: E731
    a, b, c = blocks(8, 1), blocks(12, 10), blocks(5, 20)
    return [
        StepPlan(0, new_seqs=[NewSeq(0, A), NewSeq(1, B)],
                 scheduled=[ScheduledSeq(0, 0, 7, a, True), ScheduledSeq(1, 0, 11, b, True)]),
        StepPlan(1, new_seqs=[NewSeq(2, C)], appended_tokens={0: 50, 1: 60},
                 scheduled=[ScheduledSeq(0, 7, 1, [], True), ScheduledSeq(2, 0, 5, c, True),
                            ScheduledSeq(1, 11, 1, [], True)]),
    ]


def main() -> None:
    out, engines = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    torch.set_num_threads(1)
    comm = Comm.from_mpi()
    comm.init_process_group("gloo")
    result = {}
    for engine in engines:
        m = read_manifest(engine)
        runner, _ = runner_from_engine(engine, m.backend, m.dtype, TPContext(comm.rank, comm.size), 32,
                                       m.profile.tokens_per_block, m.profile.max_num_tokens,
                                       files=EngineFiles(engine, m))
        rows = [runner.execute(p)[1] for p in plans(m.profile.tokens_per_block)]
        result[str(engine)] = {"backend": m.backend, "logits": torch.cat(rows).tolist()}
    if comm.rank == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    finish(0)
