"""Run under `mpirun -n N`: TP=N logits and in-flight batching on tiny checkpoints.

Usage: mpi_worker.py OUT.json KIND=PATH [KIND=PATH ...]. Rank 0 writes what it observed;
the test compares it with transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from runtime.core.plan import NewSeq, ScheduledSeq, StepPlan
from runtime.core.scheduler import SchedulerConfig
from runtime.dist.comm import Comm, finish
from runtime.executors.loop import LLMEngine, worker_loop
from runtime.executors.torch import runner_from_checkpoint
from runtime.models.parallel import TPContext
from tests.runtime.test_engine import BLOCK, run_staggered, staggered_workload

PROMPTS = ([1, 5, 9, 33, 7, 100, 3], [4, 8, 15, 16, 23, 42, 99, 12, 13, 14, 1])


def main() -> None:
    out_path, specs = Path(sys.argv[1]), dict(a.split("=", 1) for a in sys.argv[2:])
    torch.set_num_threads(1)
    comm = Comm.from_mpi()
    comm.init_process_group("gloo")
    tp = TPContext(comm.rank, comm.size)
    result: dict[str, object] = {"world": comm.size}
    for kind, path in specs.items():
        runner, cfg = runner_from_checkpoint(Path(path), tp, "float32", 128, BLOCK)
        a, b = PROMPTS
        _, l1 = runner.execute(StepPlan(0, new_seqs=[NewSeq(0, list(a)), NewSeq(1, list(b))], scheduled=[
            ScheduledSeq(0, 0, 7, [1, 2], True), ScheduledSeq(1, 0, 11, [3, 4, 5], True)]))
        _, l2 = runner.execute(StepPlan(1, appended_tokens={0: 50, 1: 60}, scheduled=[
            ScheduledSeq(0, 7, 1, [], True), ScheduledSeq(1, 11, 1, [], True)]))
        entry: dict[str, object] = {"logits": torch.cat([l1, l2]).tolist()}
        # In-flight batching: rank 0 schedules, the plans travel over the control plane.
        runner.seqs.clear()
        if comm.rank == 0:
            sc = SchedulerConfig(16, 32, BLOCK, 128, 256, cfg.eos_token_ids)
            engine = LLMEngine(runner, sc, comm)
            entry["generated"] = run_staggered(engine, staggered_workload())
            engine.shutdown_workers()
        else:
            worker_loop(runner, comm)
        result[kind] = entry
    if comm.rank == 0:
        out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    finish(0)
