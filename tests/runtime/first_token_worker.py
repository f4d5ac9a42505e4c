"""Run under `mpirun -n TP`: each built engine answers the demo question greedily.

Usage: first_token_worker.py OUT.json QUESTION STEPS ENGINE_DIR [ENGINE_DIR ...]. The
question is rendered by the engine's chat template as the server renders it; rank 0 writes,
per engine, the greedy tokens and each step's top logits (float32, as the engine returns them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from contract.manifest import read_manifest
from runtime.core.plan import StepPlan
from runtime.dist.comm import Comm, finish
from runtime.executors.golden import run_golden
from runtime.executors.loop import worker_loop
from runtime.executors.torch import runner_from_engine
from runtime.models.parallel import TPContext
from runtime.store.files import EngineFiles
from runtime.tokenizer import FastTokenizer


def main() -> None:
    out, question, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    engines = [Path(p) for p in sys.argv[4:]]
    torch.set_num_threads(1)
    comm = Comm.from_mpi()
    comm.init_process_group("gloo")
    result = {}
    for engine in engines:
        m = read_manifest(engine)
        runner, _ = runner_from_engine(engine, m.backend, m.dtype, TPContext(comm.rank, comm.size),
                                       64, m.profile.tokens_per_block, m.profile.max_num_tokens,
                                       files=EngineFiles(engine, m))
        if comm.rank != 0:
            worker_loop(runner, comm)
            continue
        tok = FastTokenizer(engine)
        prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True)
        tokens, tops = run_golden(runner, prompt, steps, send=comm.send_plan)
        if comm.size > 1:
            comm.send_plan(StepPlan(-1, shutdown=True))
        result[str(engine)] = {"prompt": prompt, "tokens": tokens, "text": tok.decode(tokens),
                               "top_logits": tops, "isa": m.target.isa}
    if comm.rank == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    finish(0)
