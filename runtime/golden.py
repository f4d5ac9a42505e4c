"""The golden record: a canonical prompt and what the built engine computes for it.

At build time the engine runs the prompt greedily for a few steps and records each step's
token and its top logits. At serve time (warmup gate) the loaded engine is teacher-forced
along the recorded tokens and its logits at the recorded ids must match within a tolerance
that covers legitimate floating-point noise (thread counts, kernel choice) but not a
corrupted, truncated or swapped shard.

Each rank of a TP>1 engine runs (pipeline/golden.py starts it at build time):
    mpirun -n TP python -m runtime.golden ENGINE_DIR BACKEND DTYPE BLOCK_SIZE OUT.json
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.comm import Comm, finish
from runtime.plan import NewSeq, ScheduledSeq, StepPlan
from runtime.runner import ModelRunner

GOLDEN_PROMPT = "The capital of France is"
GOLDEN_STEPS = 8
TOP_K = 5
# Relative to the largest recorded |logit|: noise across runs is far below these; a wrong
# or corrupted shard moves logits by a large fraction of their range.
TOLERANCE = {"float32": 1e-3, "bfloat16": 6e-2, "float16": 3e-2}


def golden_tolerance(dtype: str, scheme: str = "none") -> float:
    """The relative tolerance for an engine of `dtype` quantized with `scheme`.

    A quantized engine's record is produced by the quantized engine itself (its kernels, its
    dequantized weights), so what may legitimately differ at serve time is the same float
    noise as for the unquantized engine: the dtype's tolerance. Quantization error itself
    (int4: several times this tolerance, see tests/runtime/test_quant_engine.py) is never
    allowed for: an engine whose logits drifted by that much is not the engine that was built.
    """
    if scheme not in ("none", "int8_wo", "int4_wo"):
        raise ValueError(f"no golden tolerance for quantization {scheme!r}")
    return TOLERANCE[dtype]
GOLDEN_SEQ_ID = -1


def golden_prompt_ids(engine_dir: Path, vocab_size: int) -> list[int]:
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(engine_dir).encode(GOLDEN_PROMPT)
        if ids:
            return list(ids)
    except Exception:
        pass
    return [(17 * i + 3) % vocab_size for i in range(8)]


def run_golden(
    runner: ModelRunner, prompt: list[int], steps: int, forced: list[int] | None = None,
    send: Callable[[StepPlan], None] | None = None,
) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """Greedy (or teacher-forced along `forced`) steps; returns tokens and top logits.

    Uses KV blocks 1.. of the runner's cache, so it must run before admission opens.
    """
    bs = runner.block_size
    total = len(prompt) + steps
    blocks = list(range(1, (total + bs - 1) // bs + 1))
    tokens: list[int] = []
    tops: list[list[tuple[int, float]]] = []
    for i in range(steps):
        if i == 0:
            plan = StepPlan(0, new_seqs=[NewSeq(GOLDEN_SEQ_ID, list(prompt))],
                            scheduled=[ScheduledSeq(GOLDEN_SEQ_ID, 0, len(prompt), blocks, True)])
        else:
            plan = StepPlan(i, appended_tokens={GOLDEN_SEQ_ID: tokens[-1]},
                            scheduled=[ScheduledSeq(GOLDEN_SEQ_ID, len(prompt) + i - 1, 1, [], True)])
        if send:
            send(plan)
        _, logits = runner.execute(plan)
        assert logits is not None
        vals, ids = logits[0].float().topk(TOP_K)
        tops.append([(int(t), float(v)) for t, v in zip(ids, vals)])
        tokens.append(forced[i] if forced else int(ids[0]))
    done = StepPlan(steps, freed_seq_ids=[GOLDEN_SEQ_ID])
    if send:
        send(done)
    runner.apply(done)
    return tokens, tops


def check_golden(record: dict[str, Any], observed: list[list[tuple[int, float]]], dtype: str,
                 scheme: str = "none") -> tuple[bool, str]:
    """Compare teacher-forced logits at the recorded top ids; (ok, evidence)."""
    scale = max(1.0, *(abs(v) for step in record["top_logits"] for _, v in step))
    tol = golden_tolerance(dtype, scheme) * scale
    worst = 0.0
    for want, got in zip(record["top_logits"], observed):
        got_map = dict(got)
        for tok, v in want:
            # A recorded top id that fell out of our top-k is a mismatch of at least the gap.
            diff = abs(got_map[tok] - v) if tok in got_map else abs(got[-1][1] - v) + tol
            worst = max(worst, diff)
    ok = worst <= tol
    what = "" if scheme == "none" else f", {scheme}"
    return ok, (f"max logit deviation {worst:.3g} over {len(observed)} steps (tolerance {tol:.3g}"
                f"{what})")


def run_local(engine_dir: Path, backend: str, dtype: str, block_size: int,
              comm: Comm) -> dict[str, Any] | None:
    """Run the golden prompt on this process's rank; returns the record on rank 0."""
    from runtime.engine import worker_loop
    from runtime.executors.torch import runner_from_engine
    from runtime.models.parallel import TPContext

    comm.init_process_group("gloo")
    tp = TPContext(comm.rank, comm.size)
    blocks = (64 + GOLDEN_STEPS) // block_size + 2
    # The build's own fresh output: no manifest yet (it records what this run computes).
    runner, cfg = runner_from_engine(engine_dir, backend, dtype, tp, blocks, block_size)
    if comm.rank != 0:
        worker_loop(runner, comm)
        return None
    prompt = golden_prompt_ids(engine_dir, cfg.vocab_size)[:64]
    tokens, tops = run_golden(runner, prompt, GOLDEN_STEPS, send=comm.send_plan)
    if comm.size > 1:
        comm.send_plan(StepPlan(-1, shutdown=True))
    return {"prompt": GOLDEN_PROMPT, "prompt_token_ids": prompt, "tokens": tokens,
            "top_logits": tops, "dtype": dtype}


def main(argv: list[str]) -> None:
    """One rank of the build's golden run under mpirun; rank 0 writes the record."""
    engine_dir, backend, dtype, block_size, out = argv
    torch.set_num_threads(1)
    comm = Comm.from_mpi()
    code = 1
    try:
        rec = run_local(Path(engine_dir), backend, dtype, int(block_size), comm)
        if rec is not None:
            Path(out).write_text(json.dumps(rec))
        code = 0
    except Exception:
        traceback.print_exc()
    finish(code, comm)


if __name__ == "__main__":
    main(sys.argv[1:6])
