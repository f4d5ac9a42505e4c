"""The step driver shared by the scheduler's fork and fair-admission tests: requests join
at their step, every plan runs on the pure-Python mirror of the runners (with copy-on-write
of KV blocks), and every sequence's output is checked against the one any schedule must
give. (tests/unit/test_scheduler.py keeps its own, simpler driver: no n > 1.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.core.plan import StepPlan
from runtime.core.scheduler import Scheduler, SchedulerConfig
from runtime.core.sequence import Sequence
from runtime.core.types import SamplingParams
from tests.unit.test_scheduler import EOS, VOCAB, MirrorRunner, next_token


class CowRunner(MirrorRunner):
    """The mirror, plus `copied_blocks` applied before the step (as runtime/executors/runner.py)."""

    def execute(self, plan: StepPlan) -> dict[int, int]:
        bs = self.block_size
        for src, dst in plan.copied_blocks:
            for off in range(bs):
                if src * bs + off in self.kv:
                    self.kv[dst * bs + off] = self.kv[src * bs + off]
                else:
                    self.kv.pop(dst * bs + off, None)
        return super().execute(plan)


def first_token(prompt: list[int], k: int) -> int:
    """Sibling k's first token: distinct per sibling so that the outputs diverge."""
    return (next_token(prompt) + 7 * k) % VOCAB


def expected(prompt: list[int], k: int, params: SamplingParams) -> tuple[list[int], str]:
    """Sibling k's output under any schedule."""
    out = [first_token(prompt, k)]
    stop = () if params.ignore_eos else (EOS,)
    while out[-1] not in stop and len(out) < params.max_tokens:
        out.append(next_token(prompt + out))
    return out, "stop" if out[-1] in stop else "length"


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    params: SamplingParams


@dataclass
class Trace:
    """What happened to each request: the step of its first token, its outputs."""

    first_token_step: dict[int, int] = field(default_factory=dict)
    results: dict[tuple[int, int], tuple[list[int], str]] = field(default_factory=dict)
    max_rows: dict[int, int] = field(default_factory=dict)  # request -> most rows held
    steps: int = 0
    sched: Scheduler | None = None


def run(cfg: SchedulerConfig, arrivals: list[Arrival], *,
        on_step: Callable[[int, Scheduler, StepPlan], None] | None = None) -> Trace:
    """Requests join at their step (request r has seq id r); step until all finish."""
    sched, runner = Scheduler(cfg), CowRunner(cfg.block_size)
    ids = iter(range(1000, 10**6))
    index: dict[int, tuple[int, int]] = {}  # seq id -> (request, sibling)
    trace = Trace(sched=sched)
    pending = sorted(range(len(arrivals)), key=lambda r: arrivals[r].step)
    step = 0
    while pending or sched.has_unfinished():
        while pending and arrivals[pending[0]].step <= step:
            r = pending.pop(0)
            sched.add(Sequence(r, f"req-{r}", list(arrivals[r].prompt), arrivals[r].params))
            index[r] = (r, 0)
        plan = sched.schedule()
        sched.block_manager.check_integrity()
        assert plan.num_tokens <= cfg.max_num_tokens
        assert sum(s.sample + s.prompt_logits for s in plan.scheduled) <= cfg.logit_rows
        assert sum(sched._slots(s) for s in sched.running) <= cfg.max_batch_size
        rows: dict[int, int] = {}
        for s in sched.running:
            r = index[s.seq_id][0]
            rows[r] = rows.get(r, 0) + sched._slots(s)
        for r, n in rows.items():
            trace.max_rows[r] = max(trace.max_rows.get(r, 0), n)
        runner.execute(plan)
        sampled, forks = {}, {}
        for s in plan.scheduled:
            if not s.sample:
                continue
            seq = sched.get(s.seq_id)
            assert seq is not None
            tokens = seq.token_ids
            r, k = index[s.seq_id]
            sampled[s.seq_id] = first_token(tokens, k) if not seq.output_token_ids \
                else next_token(tokens)
            trace.first_token_step.setdefault(r, step)
            if seq.fork_pending:
                forks[s.seq_id] = []
                for k in range(1, seq.params.num_sequences):
                    cid = next(ids)
                    index[cid] = (r, k)
                    forks[s.seq_id].append((cid, first_token(tokens, k)))
        for seq in sched.update(plan, sampled, forks):
            if seq.finish_reason is not None:
                trace.results[index[seq.seq_id]] = (list(seq.output_token_ids),
                                                    seq.finish_reason)
        sched.block_manager.check_integrity()
        if on_step is not None:
            on_step(step, sched, plan)
        step += 1
        assert step < 20_000, "no progress"
    plan = sched.schedule()
    runner.execute(plan)
    sched.update(plan, {})
    assert sched.block_manager.num_used == 0
    trace.steps = step
    for r, a in enumerate(arrivals):
        for k in range(a.params.n):
            assert trace.results[(r, k)] == expected(a.prompt, k, a.params), (r, k)
    return trace
