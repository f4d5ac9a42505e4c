"""n > 1 (forked siblings sharing one prefill) and prompt log-probability rows in the
scheduler, against the pure-Python mirror of the runners (tests/unit/test_scheduler.py),
extended with copy-on-write of KV blocks."""

from __future__ import annotations

import random

import pytest

from runtime.core.scheduler import Scheduler, SchedulerConfig
from runtime.core.sequence import Sequence
from runtime.core.types import SamplingParams
from tests.unit.scheduler_driver import Arrival, CowRunner, expected, run
from tests.unit.test_scheduler import EOS, VOCAB, next_token


def drive(cfg: SchedulerConfig, reqs: list[tuple[list[int], SamplingParams]]
          ) -> tuple[dict[tuple[int, int], tuple[list[int], str]], Scheduler]:
    """All requests at once; results by (request, sibling index), each already checked
    against what any schedule must give."""
    trace = run(cfg, [Arrival(0, prompt, params) for prompt, params in reqs])
    assert trace.sched is not None
    return trace.results, trace.sched


def _requests(seed: int, count: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
        n = rng.choice([1, 1, 2, 3, 4])
        out.append((prompt, SamplingParams(max_tokens=rng.randint(1, 20), n=n)))
    return out


@pytest.mark.parametrize("num_blocks", [200, 24])  # roomy, and tight enough to preempt
@pytest.mark.parametrize("caching", [False, True])
def test_every_sibling_continues_its_own_prefix(num_blocks: int, caching: bool) -> None:
    reqs = _requests(num_blocks, 12)
    cfg = SchedulerConfig(max_batch_size=8, max_num_tokens=32, block_size=4,
                          num_blocks=num_blocks, max_seq_len=64, eos_token_ids=(EOS,),
                          enable_prefix_caching=caching)
    results, sched = drive(cfg, reqs)
    for r, (prompt, params) in enumerate(reqs):
        for k in range(params.n):
            assert results[(r, k)] == expected(prompt, k, params), (r, k)
    stats = sched.stats()
    assert stats.forked_sequences_total == sum(p.n - 1 for _, p in reqs)
    if num_blocks == 24:
        assert stats.preemptions_total > 0


def test_siblings_share_the_prompt_blocks_and_copy_only_the_partial_one() -> None:
    cfg = SchedulerConfig(8, 64, 4, 64, 128, (EOS,))
    sched = Scheduler(cfg)
    prompt = list(range(1, 11))  # 10 tokens: blocks of 4, 4 and a partial 2
    sched.add(Sequence(0, "r", prompt, SamplingParams(max_tokens=5, n=3)))
    plan = sched.schedule()
    assert plan.scheduled[0].sample and sched.get(0).fork_pending
    out = sched.update(plan, {0: 11}, {0: [(1, 12), (2, 13)]})
    assert [s.seq_id for s in out] == [0, 1, 2]
    parent, a, b = (sched.get(i) for i in range(3))
    assert a.block_ids[:2] == b.block_ids[:2] == parent.block_ids[:2]
    assert len({parent.block_ids[2], a.block_ids[2], b.block_ids[2]}) == 3
    assert sched.block_manager.ref_count(parent.block_ids[0]) == 3
    assert a.output_token_ids == [12] and a.num_computed_tokens == 10
    nxt = sched.schedule()
    assert nxt.copied_blocks == [(parent.block_ids[2], a.block_ids[2]),
                                 (parent.block_ids[2], b.block_ids[2])]
    assert [n.seq_id for n in nxt.new_seqs] == [1, 2]  # the runners learn the siblings
    entry = {s.seq_id: s for s in nxt.scheduled}
    assert entry[1].new_block_ids == a.block_ids and entry[1].num_computed_tokens == 10
    assert sched.stats().prompt_tokens_computed_total == 10


def test_batch_slots_are_reserved_for_siblings() -> None:
    cfg = SchedulerConfig(4, 64, 4, 64, 128, (EOS,))
    sched = Scheduler(cfg)
    sched.add(Sequence(0, "a", [1, 2, 3], SamplingParams(max_tokens=5, n=3)))
    sched.add(Sequence(1, "b", [4, 5], SamplingParams(max_tokens=5)))
    sched.add(Sequence(2, "c", [6, 7], SamplingParams(max_tokens=5)))
    plan = sched.schedule()
    # Three requests share 4 rows: "a" reserves its share (1), the others get theirs.
    # (tests/unit/test_scheduler_fair.py has the rest of the fair-share cases.)
    assert [s.seq_id for s in plan.scheduled] == [0, 1, 2]
    assert sched.get(0).fork_rows == 1
    with pytest.raises(ValueError, match="batch size"):
        sched.add(Sequence(3, "d", [1], SamplingParams(max_tokens=2, n=5)))


@pytest.mark.parametrize("wait_cap", [None, 3])
def test_prompt_logit_rows_cover_every_prompt_position_within_the_bound(
        wait_cap: int | None) -> None:
    cfg = SchedulerConfig(4, 64, 4, 64, 128, (EOS,), enable_prefix_caching=True,
                          max_logit_rows=6, max_prefill_tokens_while_waiting=wait_cap)
    sched, runner = Scheduler(cfg), CowRunner(4)
    prompt = list(range(1, 21))
    covered: list[int] = []

    def run_all() -> None:
        while sched.has_unfinished():
            plan = sched.schedule()
            assert sum(s.sample + s.prompt_logits for s in plan.scheduled) <= 6
            runner.execute(plan)
            for s in plan.scheduled:
                if s.seq_id == 1:
                    covered.extend(range(s.num_computed_tokens,
                                         s.num_computed_tokens + s.prompt_logits))
            sampled = {s.seq_id: next_token(sched.get(s.seq_id).token_ids)
                       for s in plan.scheduled if s.sample}
            sched.update(plan, sampled)

    # A first request fills the prefix cache; the second must not use it (it needs rows).
    sched.add(Sequence(0, "warm", prompt, SamplingParams(max_tokens=1)))
    run_all()
    computed = sched.stats().prompt_tokens_computed_total
    sched.add(Sequence(1, "echo", prompt, SamplingParams(max_tokens=2, prompt_logprobs=1)))
    sched.add(Sequence(2, "other", prompt[:9] + [3], SamplingParams(max_tokens=3)))
    run_all()
    assert covered == list(range(len(prompt) - 1))
    stats = sched.stats()
    assert stats.prefix_cache_hits_total == 8  # "other" hit two blocks, "echo" none
    assert stats.prompt_tokens_computed_total - computed == 20 + 2
