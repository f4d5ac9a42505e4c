"""The golden record: a canonical prompt and what the built engine computes for it.

At build time the engine runs the prompt greedily for a few steps and records each step's
token and its top logits. At serve time (warmup gate) the loaded engine is teacher-forced
along the recorded tokens and its logits at the recorded ids must match within a tolerance
that covers legitimate floating-point noise (thread counts, kernel choice) but not a
corrupted, truncated or swapped shard.

Each rank of a TP>1 engine runs (pipeline/golden.py starts it at build time):
    mpirun -n TP python -m runtime.executors.golden ENGINE_DIR BACKEND DTYPE BLOCK_SIZE OUT.json MAX_TOKENS [DEVICE [DECODE_BATCH]]
"""

from __future__ import annotations

import io
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from contract.layout import FIDELITY_FILE
from runtime.core.plan import NewSeq, ScheduledSeq, StepPlan
from runtime.dist.comm import Comm, finish
from runtime.executors.runner import ModelRunner

GOLDEN_PROMPT = "The capital of France is"
GOLDEN_STEPS = 8
# The build's fidelity text (pipeline/fidelity.py): the engine's log-probabilities of each
# next token, against transformers float32 and its own 16-bit dtype on the same weights.
FIDELITY_TEXT = (
    "The Loire is the longest river in France. It rises in the Massif Central, flows north "
    "towards Orleans, then turns west through Tours and Nantes before it reaches the Atlantic. "
    "Its valley is known for its castles, its vineyards and its gardens, and a stretch of it "
    "has been a World Heritage Site since 2000. In summer the river is shallow and slow; in "
    "winter it can flood the towns along its banks."
)
FIDELITY_MAX_TOKENS = 128
TOP_K = 5
# Relative to the largest recorded |logit|: a wrong or corrupted shard moves logits by a large
# fraction of their range; the legitimate noise between the build's run (a prefill, then one
# decode step a token) and the warmup gate's (one prefill of the forced tokens, then a decode
# batch; 1 or 2 threads) is measured. bf16, SmolLM2-135M (float32 logits, scale 34): worst
# 0.142 on AVX512-BF16 (oneDNN's prefill against vdpbf16ps decode rows: 0.42 %), 0.000 on
# AVX2 (the panel kernel's rows do not depend on the batch); the tolerance is 3.6x that
# worst. Before float32 logits it was 6e-2 (2.05 logits): wider than most near ties.
# float16 (3e-2) and float32 (1e-3) were not re-measured.
TOLERANCE = {"float32": 1e-3, "bfloat16": 1.5e-2, "float16": 3e-2}


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


def run_golden_forced(
    runner: ModelRunner, prompt: list[int], forced: list[int], max_tokens: int,
    send: Callable[[StepPlan], None] | None = None, decode_batch: int = 1,
    watch: list[list[int]] | None = None,
) -> tuple[list[list[tuple[int, float]]], list[dict[str, Any]]] | None:
    """The teacher-forced golden run in two steps instead of one per token: a prefill of
    the prompt and every forced token but the last, whose logits rows give every step's
    logits but the last one's, then one decode step for the last, run as a batch of
    `decode_batch` rows (the other rows are throwaway sequences, one block each). Returns
    the top logits per step (and the logits of the ids in `watch[step]`, the record's top
    ids: a prefill computes in another order than a decode, and a near tie may swap the
    last of the top ids) and the two steps' shapes and times; None when the chunk or its
    logits rows exceed the step's token budget `max_tokens` (use run_golden).

    Uses KV blocks 1.. of the runner's cache, so it must run before admission opens.
    """
    import time

    n, p, bs = len(forced), len(prompt), runner.block_size
    chunk = [*prompt, *forced[: n - 2]]
    if n < 2 or len(chunk) > max_tokens:
        return None
    blocks = list(range(1, (p + n - 1 + bs - 1) // bs + 1))
    spare = list(range(blocks[-1] + 1, runner.kv_cache.shape[2]))
    others = [-2 - i for i in range(min(decode_batch - 1, len(spare)))]
    steps = [
        StepPlan(0, new_seqs=[NewSeq(GOLDEN_SEQ_ID, chunk)], scheduled=[
            ScheduledSeq(GOLDEN_SEQ_ID, 0, len(chunk), blocks, True,
                         prompt_logits=len(chunk) - 1)]),
        StepPlan(1, appended_tokens={GOLDEN_SEQ_ID: forced[n - 2]},
                 new_seqs=[NewSeq(s, [1, 2]) for s in others],
                 scheduled=[ScheduledSeq(GOLDEN_SEQ_ID, len(chunk), 1, [], True),
                            *(ScheduledSeq(s, 1, 1, [spare[i]], True)
                              for i, s in enumerate(others))]),
    ]
    rows: list[torch.Tensor] = []
    shapes: list[dict[str, Any]] = []
    for plan, what in zip(steps, (f"prefill {len(chunk)} tokens, {len(chunk)} logits rows",
                                  f"decode batch {1 + len(others)}")):
        if send:
            send(plan)
        t0 = time.perf_counter()
        _, logits = runner.execute(plan)
        shapes.append({"shape": what, "rows": len(plan.scheduled),
                       "ms": round((time.perf_counter() - t0) * 1e3, 2)})
        assert logits is not None
        if plan.step_id == 0:  # row 0: the chunk's last position; then positions 0..
            rows.extend(logits[1 + p - 1 : 1 + len(chunk) - 1])
            rows.append(logits[0])
        else:
            rows.append(logits[0])
    done = StepPlan(2, freed_seq_ids=[GOLDEN_SEQ_ID, *others])
    if send:
        send(done)
    runner.apply(done)
    tops = []
    for i, row in enumerate(rows):
        row = row.float()
        vals, ids = row.topk(TOP_K)
        top = [(int(t), float(v)) for t, v in zip(ids, vals)]
        seen = {t for t, _ in top}
        extra = [(t, float(row[t])) for t in (watch[i] if watch else []) if t not in seen]
        tops.append(top + extra)
    return tops, shapes


def replay_golden(
    runner: ModelRunner, record: dict[str, Any], max_tokens: int, decode_batch: int,
    send: Callable[[StepPlan], None] | None = None, fast: bool = True,
) -> tuple[list[list[tuple[int, float]]], dict[str, Any], Any]:
    """The warmup gate's run of the golden record: (the top logits observed, the record to
    check them against, what ran). `fast`: the two-step teacher-forced run at the record's
    decode batch (else `decode_batch`: the prefill path and the largest decode batch
    exercised once; `max_tokens`, the step's token budget, bounds the prefill), checked
    against the build's own run of those two steps; otherwise one step a token, checked
    against the build's greedy run, which it repeats step for step.

    Like is compared with like: a kernel may choose its path by the rows in a call (bf16
    int4 linears on AMX: tiles on bf16 inputs from 8 rows, VNNI passes on int8-quantized
    inputs below), so the prefill of the forced tokens and the build's one-token decode
    steps differ by more than float noise (SmolLM2 int4, Xeon with AMX: 0.47 logits,
    tolerance 0.433) though both are the engine as built. A record from before the build
    ran the two steps (no "forced") is checked against its greedy run either way."""
    prompt, tokens = record["prompt_token_ids"], record["tokens"]
    forced = record.get("forced")
    if fast:
        ref = forced if forced is not None else record
        out = run_golden_forced(
            runner, prompt, tokens, max_tokens, send,
            decode_batch=forced["decode_batch"] if forced is not None else decode_batch,
            watch=[[t for t, _ in step] for step in ref["top_logits"]])
        if out is not None:
            tops, shapes = out
            return tops, ref, shapes
    _, tops = run_golden(runner, prompt, len(tokens), forced=tokens, send=send)
    return tops, record, len(tokens)


def check_golden(record: dict[str, Any], observed: list[list[tuple[int, float]]], dtype: str,
                 scheme: str = "none") -> tuple[bool, str]:
    """Compare teacher-forced logits at the recorded top ids; (ok, evidence).

    Two checks: every recorded top logit within the tolerance, and no greedy choice flipped
    whose recorded lead over the runner-up exceeds the tolerance (a near tie, closer than
    the noise, may go either way; a clear lead may not)."""
    scale = max(1.0, *(abs(v) for step in record["top_logits"] for _, v in step))
    tol = golden_tolerance(dtype, scheme) * scale
    worst = 0.0
    flips = []
    for i, (want, got) in enumerate(zip(record["top_logits"], observed)):
        got_map = dict(got)
        got = got[:TOP_K]
        for tok, v in want:
            # A recorded top id that fell out of our top-k is a mismatch of at least the gap.
            diff = abs(got_map[tok] - v) if tok in got_map else abs(got[-1][1] - v) + tol
            worst = max(worst, diff)
        if len(want) > 1 and want[0][1] - want[1][1] > tol and got[0][0] != want[0][0]:
            flips.append(i)
    ok = worst <= tol and not flips
    what = "" if scheme == "none" else f", {scheme}"
    flipped = f"; greedy token flipped at steps {flips}" if flips else ""
    return ok, (f"max logit deviation {worst:.3g} over {len(observed)} steps (tolerance {tol:.3g}"
                f"{what}){flipped}")


def fidelity_ids(engine_dir: Path, vocab_size: int, max_tokens: int) -> list[int]:
    """FIDELITY_TEXT's token ids (at most max_tokens), or made-up ids without a tokenizer."""
    n = min(FIDELITY_MAX_TOKENS, max_tokens)
    try:
        from runtime.tokenizer import FastTokenizer

        ids = FastTokenizer(engine_dir).encode(FIDELITY_TEXT)
        if len(ids) >= 2:
            return list(ids)[:n]
    except Exception:
        pass
    return [(31 * i + 7) % vocab_size for i in range(n)]


def run_logprobs(runner: ModelRunner, ids: list[int],
                 send: Callable[[StepPlan], None] | None = None) -> torch.Tensor:
    """One prefill of `ids`; the float32 log-softmax of every position but the last
    ([len(ids) - 1, vocab]: row i predicts ids[i + 1]). Uses KV blocks 1.., before admission."""
    n, bs = len(ids), runner.block_size
    blocks = list(range(1, (n + bs - 1) // bs + 1))
    plan = StepPlan(0, new_seqs=[NewSeq(GOLDEN_SEQ_ID, list(ids))], scheduled=[
        ScheduledSeq(GOLDEN_SEQ_ID, 0, n, blocks, True, prompt_logits=n - 1)])
    if send:
        send(plan)
    _, logits = runner.execute(plan)
    assert logits is not None
    done = StepPlan(1, freed_seq_ids=[GOLDEN_SEQ_ID])
    if send:
        send(done)
    runner.apply(done)
    return torch.log_softmax(logits[1:n].float(), dim=-1)  # row 0 is the sampled last position


def run_local(engine_dir: Path, backend: str, dtype: str, block_size: int,
              comm: Comm, max_tokens: int = 0, device: str = "cpu",
              decode_batch: int = 1) -> dict[str, Any] | None:
    """Run the golden prompt on this process's rank; returns the record on rank 0: the
    greedy run, one step a token, and with `max_tokens` (the profile's token budget) the
    warmup gate's two teacher-forced steps along its tokens at `decode_batch` (the profile's
    largest batch) as "forced" (replay_golden), and the fidelity text's log-probabilities,
    saved as engine_dir/FIDELITY_FILE for the build to compare (pipeline/fidelity.py).
    `device`: the target's ("cpu" or "cuda"), where the engine runs as the server runs it
    (a rank's GPU by its local rank, NCCL between ranks)."""
    from runtime.executors.loop import worker_loop
    from runtime.executors.torch import runner_from_engine
    from runtime.models.parallel import TPContext

    if device == "cuda":
        device = f"cuda:{comm.local_rank % max(1, torch.cuda.device_count())}"
        torch.cuda.set_device(device)
    comm.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    tp = TPContext(comm.rank, comm.size)
    # the prompt (or the fidelity text), and one block each for the forced decode batch's
    # other rows
    blocks = (max(64 + GOLDEN_STEPS, FIDELITY_MAX_TOKENS)) // block_size + 2 + decode_batch
    # The build's own fresh output: no manifest yet (it records what this run computes).
    runner, cfg = runner_from_engine(engine_dir, backend, dtype, tp, blocks, block_size,
                                     max_tokens or None, device)
    if comm.rank != 0:
        worker_loop(runner, comm)
        return None
    prompt = golden_prompt_ids(engine_dir, cfg.vocab_size)[:64]
    tokens, tops = run_golden(runner, prompt, GOLDEN_STEPS, send=comm.send_plan)
    record: dict[str, Any] = {"prompt": GOLDEN_PROMPT, "prompt_token_ids": prompt,
                              "tokens": tokens, "top_logits": tops, "dtype": dtype}
    fast = run_golden_forced(runner, prompt, tokens, max_tokens, comm.send_plan,
                             decode_batch=decode_batch) if max_tokens else None
    if fast is not None:
        record["forced"] = {"decode_batch": fast[1][1]["rows"], "top_logits": fast[0]}
    if max_tokens >= 2:
        ids = fidelity_ids(engine_dir, cfg.vocab_size, max_tokens)
        logprobs = run_logprobs(runner, ids, send=comm.send_plan)
        # Serialized in memory, written as plain bytes: a full disk is then the OSError
        # (ENOSPC) the build reports as such, not torch's zip writer's RuntimeError.
        buf = io.BytesIO()
        torch.save({"ids": ids, "logprobs": logprobs.cpu()}, buf)
        (engine_dir / FIDELITY_FILE).write_bytes(buf.getbuffer())
    if comm.size > 1:
        comm.send_plan(StepPlan(-1, shutdown=True))
    return record


def main(argv: list[str]) -> None:
    """One rank of the build's golden run under mpirun; rank 0 writes the record."""
    engine_dir, backend, dtype, block_size, out, max_tokens, *rest = argv
    torch.set_num_threads(1)
    comm = Comm.from_mpi()
    code = 1
    try:
        rec = run_local(Path(engine_dir), backend, dtype, int(block_size), comm, int(max_tokens),
                        rest[0] if rest else "cpu", int(rest[1]) if len(rest) > 1 else 1)
        if rec is not None:
            Path(out).write_text(json.dumps(rec))
        code = 0
    except Exception:
        traceback.print_exc()
    finish(code, comm)


if __name__ == "__main__":
    main(sys.argv[1:9])
