"""Shape-representative warmup, largest first, driven by rank 0 through ordinary plans.

The shapes come from the build profile: one prefill chunk of the full token budget, then
decode steps at batch sizes max, ..., 4, 2, 1. Largest first so that a shape the memory
cannot hold fails the gate at once, before any smaller one has hidden the problem.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from contract.profile import BuildProfile
from runtime.core.plan import NewSeq, ScheduledSeq, StepPlan
from runtime.dist.comm import Comm
from runtime.executors.runner import ModelRunner

PHASE_DONE = -2  # step id of the plan that ends a driven phase on ranks > 0
_SEQ_BASE = -1000


class Interrupted(Exception):
    """A stop signal arrived between two warmup shapes."""


def decode_batch_sizes(max_batch: int) -> list[int]:
    sizes, b = {max_batch}, 1
    while b < max_batch:
        sizes.add(b)
        b *= 2
    return sorted(sizes, reverse=True)


def _run(runner: ModelRunner, plan: StepPlan, send: Callable[[StepPlan], None]) -> float:
    send(plan)
    t0 = time.perf_counter()
    runner.execute(plan)
    return (time.perf_counter() - t0) * 1e3


def warm_prefill(runner: ModelRunner, profile: BuildProfile, num_blocks: int,
                 send: Callable[[StepPlan], None], tokens: int) -> dict[str, float | int | str]:
    """One throwaway prompt of `tokens` tokens (capped by what one sequence and the cache
    hold) computed in one step on KV blocks 1.., then freed; returns its shape and time."""
    bs = profile.tokens_per_block
    usable = list(range(1, num_blocks))
    n = min(tokens, profile.max_num_tokens, profile.max_seq_len - 1, len(usable) * bs)
    sid = _SEQ_BASE
    plan = StepPlan(0, new_seqs=[NewSeq(sid, [1] * n)],
                    scheduled=[ScheduledSeq(sid, 0, n, usable[: (n + bs - 1) // bs], True)])
    ms = _run(runner, plan, send)
    free = StepPlan(1, freed_seq_ids=[sid])
    send(free)
    runner.apply(free)
    return {"shape": f"prefill {n} tokens", "ms": round(ms, 2)}


def warmup_shapes(
    runner: ModelRunner, profile: BuildProfile, num_blocks: int, send: Callable[[StepPlan], None],
    interrupted: Callable[[], bool] = lambda: False,
) -> list[dict[str, float | int | str]]:
    """Run every shape; raises Interrupted between two shapes once `interrupted()` is true,
    so a stop signal waits for one step, not for the whole warmup."""
    usable = list(range(1, num_blocks))
    # Prefill: the whole token budget in one chunk.
    done = [warm_prefill(runner, profile, num_blocks, send, profile.max_num_tokens)]
    step = 2

    # Decode: b sequences with a short context each, one token per sequence.
    for b in decode_batch_sizes(min(profile.max_batch_size, len(usable))):
        if interrupted():
            raise Interrupted
        ids = [_SEQ_BASE - 1 - i for i in range(b)]
        plan = StepPlan(step, new_seqs=[NewSeq(s, [1, 2]) for s in ids], scheduled=[
            ScheduledSeq(s, 1, 1, [usable[i]], True) for i, s in enumerate(ids)])
        # Pre-fill position 0 of each sequence's block through the same step: the step
        # computes position 1 with position 0 unwritten, which is fine for warmup.
        ms = _run(runner, plan, send)
        done.append({"shape": f"decode batch {b}", "ms": round(ms, 2)})
        free = StepPlan(step + 1, freed_seq_ids=ids)
        send(free)
        runner.apply(free)
        step += 2
    return done


def follow(runner: ModelRunner, comm: Comm) -> None:
    """Ranks > 0 during a driven phase: execute rank 0's plans until PHASE_DONE."""
    while True:
        plan = comm.recv_plan()
        if plan.step_id == PHASE_DONE:
            return
        runner.execute(plan)
