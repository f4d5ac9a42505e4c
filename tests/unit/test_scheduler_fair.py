"""Fair admission (issue #37 item 5), step by step: a request's share of the batch rows
(n and best_of count against it), the first token of a request that arrives while a long
prompt prefills, and `priority` (lower first, as vLLM's). Every case also checks, against
the pure-Python mirror of the runners, that each sequence's output is the one any schedule
must give: taking rows back by preemption must never change what a request gets."""

from __future__ import annotations

import random

import pytest

from runtime.core.plan import StepPlan
from runtime.core.scheduler import Scheduler, SchedulerConfig
from runtime.core.sequence import SeqStatus, Sequence
from runtime.core.types import SamplingParams
from tests.unit.scheduler_driver import Arrival, run
from tests.unit.test_scheduler import EOS, VOCAB


def cfg(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(max_batch_size=8, max_num_tokens=64, block_size=4,
                                   num_blocks=1 + 256, max_seq_len=256, eos_token_ids=(EOS,))
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % (VOCAB - 1) + 1 for i in range(n)]


LONG = dict(max_tokens=60, ignore_eos=True)

# ---- rows: one request cannot hold the batch -----------------------------------------


@pytest.mark.parametrize("caching", [False, True])
def test_a_request_holding_every_row_gives_rows_back_to_new_arrivals(caching: bool) -> None:
    """n=8 takes the whole batch of 8 while alone; three one-token requests that arrive
    later each get a row (a sibling is preempted for it) within two steps, instead of
    waiting the 60 steps until the siblings finish."""
    arrivals = [Arrival(0, prompt(6), SamplingParams(n=8, **LONG))]
    arrivals += [Arrival(5 + i, prompt(5, salt=i + 1), SamplingParams(max_tokens=1))
                 for i in range(3)]
    trace = run(cfg(enable_prefix_caching=caching), arrivals)
    assert trace.max_rows[0] == 8  # alone, it had every row
    for r in (1, 2, 3):
        assert trace.first_token_step[r] - arrivals[r].step <= 1, trace.first_token_step
    stats = trace.sched.stats()
    assert stats.rows_reclaimed_total >= 1
    assert stats.forked_sequences_total == 7


def test_a_reservation_shrinks_before_anything_is_preempted() -> None:
    """While n=8 still prefills, its rows are only reserved: a new arrival takes one of
    them back for free (no preemption), and the sibling without a row waits."""
    arrivals = [Arrival(0, prompt(40), SamplingParams(n=8, **LONG)),
                Arrival(1, prompt(3, salt=9), SamplingParams(max_tokens=2))]
    seen: list[tuple[int, int]] = []

    def watch(step: int, sched: Scheduler, _plan: object) -> None:
        parent = sched.get(0)
        if parent is not None and parent.fork_pending:
            seen.append((step, parent.fork_rows))

    trace = run(cfg(max_num_tokens=16), arrivals, on_step=watch)
    assert seen[0] == (0, 8) and seen[1] == (1, 7)
    assert trace.first_token_step[1] == 1
    assert trace.sched.stats().preemptions_total == 0


def test_siblings_reserve_rows_within_their_share() -> None:
    sched = Scheduler(SchedulerConfig(4, 64, 4, 64, 128, (EOS,)))
    sched.add(Sequence(0, "a", [1, 2, 3], SamplingParams(max_tokens=5, n=3)))
    plan = sched.schedule()
    assert sched.get(0).fork_rows == 3  # alone: rows for every sibling
    sched.add(Sequence(1, "b", [4, 5], SamplingParams(max_tokens=5)))
    sched.add(Sequence(2, "c", [6, 7], SamplingParams(max_tokens=5)))
    sched.update(plan, {0: 11}, {0: [(10, 12), (11, 13)]})
    assert [s.seq_id for s in sched.running] == [0, 10, 11]
    plan = sched.schedule()  # one row free: "b" takes it
    assert [n.seq_id for n in plan.new_seqs] == [10, 11, 1]
    sched.update(plan, {s.seq_id: 7 for s in plan.scheduled if s.sample})
    plan = sched.schedule()  # none free: "a" holds 3 of 4 rows, its share is 1
    assert plan.freed_seq_ids == [11] and [n.seq_id for n in plan.new_seqs] == [2]
    assert sched.get(11).status is SeqStatus.WAITING
    assert sched.stats().rows_reclaimed_total == 1


def test_shares_split_the_batch_between_many_n_requests() -> None:
    """Four n=4 requests on a batch of 8 at once: none holds more than its share of 2 when
    the others want rows, and all of them get their first token in the first steps."""
    arrivals = [Arrival(0, prompt(5, salt=i), SamplingParams(n=4, max_tokens=12,
                                                             ignore_eos=True))
                for i in range(4)]
    trace = run(cfg(), arrivals)
    assert all(trace.first_token_step[r] <= 1 for r in range(4)), trace.first_token_step
    assert all(trace.max_rows[r] <= 4 for r in range(4))


# ---- time to first token behind a long prompt -----------------------------------------


@pytest.mark.parametrize("decode_cap", [None, 16])
def test_a_short_request_is_not_held_back_by_a_long_prefill(decode_cap: int | None) -> None:
    """A 240-token prompt takes 8 steps of 32 tokens. A 5-token request that arrives at
    its second step gets its first token in that step; the long prompt still gets at
    least half of the step's prompt tokens."""
    arrivals = [Arrival(0, prompt(240), SamplingParams(max_tokens=4)),
                Arrival(1, prompt(5, salt=3), SamplingParams(max_tokens=4))]
    chunks: list[int] = []

    def watch(step: int, _sched: Scheduler, plan: object) -> None:
        for s in plan.scheduled:  # type: ignore[attr-defined]
            if s.seq_id == 0 and s.num_new_tokens > 1:
                chunks.append(s.num_new_tokens)

    extra = {} if decode_cap is None else dict(max_prefill_tokens_while_decoding=decode_cap)
    if decode_cap is not None:  # something decodes the whole time: the cap applies
        arrivals.append(Arrival(0, prompt(3, salt=5), SamplingParams(**LONG)))
    trace = run(cfg(max_num_tokens=32, **extra), arrivals, on_step=watch)
    assert trace.first_token_step[1] == 1
    step_prompt = decode_cap or 32
    assert min(chunks) >= step_prompt // 2 and sum(chunks) == 240


@pytest.mark.parametrize("wait_cap", [None, 8])
def test_many_short_arrivals_do_not_starve_the_long_prompt(wait_cap: int | None) -> None:
    """A short request arrives every step: each gets its first token in its arrival
    step, and the long prompt still finishes within twice its unhindered steps (with
    max_prefill_tokens_while_waiting, it still gets that many tokens every step)."""
    arrivals = [Arrival(0, prompt(240), SamplingParams(max_tokens=2))]
    arrivals += [Arrival(1 + i, prompt(4, salt=i), SamplingParams(max_tokens=2))
                 for i in range(20)]
    trace = run(cfg(max_num_tokens=32, max_prefill_tokens_while_waiting=wait_cap), arrivals)
    assert all(trace.first_token_step[r] == arrivals[r].step for r in range(1, 21))
    if wait_cap is None:
        assert trace.first_token_step[0] <= 2 * 240 // 32
    else:  # 32 in step 0, at least 8 in each of the 20 steps with an arrival, then 32 again
        assert trace.first_token_step[0] <= 1 + 20 + (240 - 32 - 20 * 8) // 32 + 1


@pytest.mark.parametrize("decode_cap", [None, 16])
@pytest.mark.parametrize("wait_cap", [None, 8])
def test_a_newcomer_gets_its_first_token_one_short_step_after_the_step_in_flight(
        wait_cap: int | None, decode_cap: int | None) -> None:
    """Issue #37 item 5, the bench's case scaled down: a 200-token prompt on a 64-token
    budget; a 3-token request is added after its first step (it arrived during it). It is
    admitted and sampled in the next step, but without max_prefill_tokens_while_waiting
    that step also carries the long prompt's full chunk (the newcomer's first token is as
    late as the budget allows); with it, that step computes at most the cap + 3 tokens
    (+ the decodes), and the long prompt still progresses in every step."""
    t = 0 if decode_cap is None else 1  # the long prompt's first step
    arrivals = [Arrival(t, prompt(200), SamplingParams(max_tokens=4)),
                Arrival(t + 1, prompt(3, salt=3), SamplingParams(max_tokens=4))]
    extra: dict[str, object] = {}
    if decode_cap is not None:  # something decodes the whole time: that cap applies too
        extra["max_prefill_tokens_while_decoding"] = decode_cap
        arrivals.append(Arrival(0, prompt(3, salt=5), SamplingParams(**LONG)))
    tokens: list[int] = []  # computed per step
    long_chunks: list[int] = []  # the long prompt's tokens per step

    def watch(_step: int, _sched: Scheduler, plan: StepPlan) -> None:
        tokens.append(plan.num_tokens)
        long_chunks.append(sum(s.num_new_tokens for s in plan.scheduled if s.seq_id == 0))

    trace = run(cfg(max_num_tokens=64, max_prefill_tokens_while_waiting=wait_cap, **extra),
                arrivals, on_step=watch)
    decodes = 0 if decode_cap is None else 1
    step_tokens = decodes + (decode_cap or 64)  # a step with nobody waiting
    assert trace.first_token_step[1] == t + 1  # the step after the one in flight
    assert tokens[t] == step_tokens  # nobody waits: no wait cap
    if wait_cap is None:  # the step is as long as ever: the newcomer's TTFT, before
        assert tokens[t + 1] == step_tokens
    else:
        assert tokens[t + 1] <= wait_cap + 3 + decodes
    long_chunks = long_chunks[t:trace.first_token_step[0] + 1]
    assert min(long_chunks) >= 1 and sum(long_chunks) == 200


# ---- priority ---------------------------------------------------------------------------


def test_a_high_priority_request_overtakes_waiting_low_ones() -> None:
    """The batch is full; three requests wait (priority 5), then one with priority -1
    arrives: it is admitted first when a row frees, the others in arrival order."""
    arrivals = [Arrival(0, prompt(4, salt=i), SamplingParams(max_tokens=3 + 2 * i))
                for i in range(2)]
    arrivals += [Arrival(1, prompt(4, salt=10 + i), SamplingParams(max_tokens=3, priority=5))
                 for i in range(3)]
    arrivals.append(Arrival(2, prompt(4, salt=20), SamplingParams(max_tokens=3, priority=-1)))
    trace = run(cfg(max_batch_size=2), arrivals)
    firsts = trace.first_token_step
    assert firsts[5] < min(firsts[2], firsts[3], firsts[4])
    assert firsts[2] <= firsts[3] <= firsts[4]


def test_the_pool_preempts_the_least_important_first() -> None:
    """Blocks run out: the victim is the lowest-priority sequence, not the last arrival."""
    sched = Scheduler(cfg(num_blocks=1 + 20, max_seq_len=128))
    sched.add(Sequence(0, "low", prompt(8), SamplingParams(priority=3, **LONG)))
    plan = sched.schedule()
    sched.update(plan, {0: 5})
    sched.add(Sequence(1, "high", prompt(8, salt=1), SamplingParams(priority=0, **LONG)))
    preempted = None
    for _ in range(40):
        plan = sched.schedule()
        sched.update(plan, {s.seq_id: 5 for s in plan.scheduled if s.sample})
        if sched.stats().preemptions_total:
            preempted = [s.seq_id for s in sched.waiting]
            break
    assert preempted == [0]
    assert [s.seq_id for s in sched.running] == [1]


def test_priority_is_validated() -> None:
    for bad in (True, 1.5, "1", 2**31, -(2**31) - 1):
        with pytest.raises(ValueError, match="priority"):
            SamplingParams(priority=bad)  # type: ignore[arg-type]
    assert SamplingParams(priority=-(2**31)).priority == -(2**31)


# ---- everything at once ----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_batch_size=4, max_num_tokens=16, num_blocks=1 + 30),
    dict(max_batch_size=4, max_num_tokens=16, num_blocks=1 + 30, enable_prefix_caching=True),
    dict(max_num_tokens=24, max_prefill_tokens_while_decoding=6, enable_prefix_caching=True),
    dict(max_num_tokens=24, max_prefill_tokens_while_waiting=3, enable_prefix_caching=True),
    dict(max_batch_size=4, max_num_tokens=16, num_blocks=1 + 30,
         max_prefill_tokens_while_decoding=5, max_prefill_tokens_while_waiting=1),
], ids=["roomy", "tight", "tight-cache", "decode-cap", "wait-cap", "tight-both-caps"])
def test_random_mixes_give_every_sequence_its_own_output(seed: int, kw: dict) -> None:
    rng = random.Random(seed)
    arrivals = []
    for _ in range(24):
        n = rng.choice([1, 1, 1, 2, 4, 8]) if kw.get("max_batch_size") != 4 else \
            rng.choice([1, 1, 2, 4])
        arrivals.append(Arrival(rng.randint(0, 30),
                                prompt(rng.randint(1, 50), salt=rng.randrange(VOCAB)),
                                SamplingParams(n=n, max_tokens=rng.randint(1, 20),
                                               priority=rng.choice([0, 0, -1, 2]))))
    run(cfg(**kw), arrivals)  # asserts each output and the rows bound
