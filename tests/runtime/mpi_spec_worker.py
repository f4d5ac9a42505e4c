"""Run under `mpirun -n 2`: plain and speculative greedy decoding on one tiny checkpoint at
TP=2, rank 0 scheduling (the drafts and accepted tokens reach rank 1 through the plans).

Usage: mpi_spec_worker.py OUT.json PATH. PATH: a checkpoint (float32, eager) or a built
engine. Rank 0 writes both runs' outputs, and their greedy requests' token log-probabilities
(asked for on every greedy request).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from contract.manifest import read_manifest
from contract.speculative import Speculative
from runtime.core.scheduler import SchedulerConfig
from runtime.dist.comm import Comm, finish
from runtime.executors.loop import LLMEngine, worker_loop
from runtime.executors.torch import runner_from_checkpoint, runner_from_engine
from runtime.models.parallel import TPContext
from runtime.store.files import EngineFiles
from tests.runtime.spec_workload import build_workload, run_requests

BLOCK = 4


def main() -> None:
    out_path, path = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    comm = Comm.from_mpi()
    comm.init_process_group("gloo")
    tp = TPContext(comm.rank, comm.size)
    block = BLOCK
    if (path / "manifest.json").is_file():
        m = read_manifest(path)
        block = m.profile.tokens_per_block
        runner, cfg = runner_from_engine(path, m.backend, m.dtype, tp, 256, block,
                                         m.profile.max_num_tokens, files=EngineFiles(path, m))
    else:
        runner, cfg = runner_from_checkpoint(path, tp, "float32", 256, BLOCK)
    result: dict[str, object] = {"world": comm.size}
    reqs = None
    for name, spec in (("free", Speculative("ngram", 5)), ("plain", None),
                       ("spec", Speculative("ngram", 5))):
        runner.seqs.clear()
        if comm.rank != 0:
            worker_loop(runner, comm)
            continue
        sc = SchedulerConfig(8, 64, block, 256, 256, cfg.eos_token_ids,
                             enable_prefix_caching=True, speculative=spec,
                             spec_max_batch_size=8)  # the verify path at every batch size
        engine = LLMEngine(runner, sc, comm)
        if reqs is None:
            reqs = [(p, dataclasses.replace(s, logprobs=0) if s.greedy else s)
                    for p, s in build_workload(engine)]
            result["stops"] = [list(p.stop_token_ids) for _, p in reqs]
        else:
            lps: dict[str, list[float]] = {}
            got = run_requests(engine, reqs, logprobs=lps)
            # Greedy requests only: a sampled one speculates too, and draws its random
            # numbers differently when it verifies drafts.
            result[name] = {k: v[:2] for k, v in got.items() if reqs[int(k)][1].greedy}
            result[name + "_logprobs"] = {k: v for k, v in lps.items() if reqs[int(k)][1].greedy}
            if spec is not None:
                result["accepted"] = engine.stats().extra["spec_decode_num_accepted_tokens_total"]
        engine.shutdown_workers()
    if comm.rank == 0:
        out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    finish(0)
