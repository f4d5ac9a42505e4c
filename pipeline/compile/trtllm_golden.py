"""The golden run of a freshly built TensorRT-LLM engine, in a process of its own.

    [mpirun -n TP] python -m pipeline.compile.trtllm_golden ENGINE_DIR IO.json

IO.json holds {"prompt_token_ids": [...], "steps": N} on the way in; rank 0 adds "tokens".
LEADER mode: every rank constructs the Executor; rank 0 runs the prompt greedily; the other
ranks block in shutdown() until rank 0 shuts down. The prompt is tokenized by the parent, so
this process imports neither torch nor transformers (only TensorRT-LLM).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def golden_tokens(engine_dir: Path, prompt: list[int], steps: int) -> list[int] | None:
    """Rank 0: the greedy tokens; other ranks: None once the leader has shut down."""
    from runtime.core.types import SamplingParams
    from runtime.executors.trtllm import TrtllmExecutor
    from runtime.executors.trtllm_setup import construct_executor, kv_cache_config

    ex = construct_executor(engine_dir, kv_cache_config(None, None))
    if not ex.can_enqueue_requests():
        ex.shutdown()  # blocks until the leader shuts down
        return None
    adapter = TrtllmExecutor(ex)
    try:
        greedy = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        [(tokens, _)] = adapter.generate([prompt], [greedy], timeout_s=300)
    finally:
        adapter.shutdown()
    return tokens


if __name__ == "__main__":
    _dir, _io = Path(sys.argv[1]), Path(sys.argv[2])
    io = json.loads(_io.read_text())
    out = golden_tokens(_dir, io["prompt_token_ids"], io["steps"])
    if out is not None:
        _io.write_text(json.dumps({**io, "tokens": out}))
