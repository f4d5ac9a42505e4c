from __future__ import annotations

import hashlib
import pickle
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from runtime.core.plan import NULL_BLOCK, StepPlan
from runtime.core.scheduler import Scheduler, SchedulerConfig
from runtime.core.sequence import SeqStatus, Sequence
from runtime.core.types import SamplingParams

EOS = 0
VOCAB = 40


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': the next token is a function of the whole prefix."""
    digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


class MirrorRunner:
    """The runner-side bookkeeping in pure Python, applying plans in the documented order.

    It keeps its own tokens and block table per sequence, plus a simulated KV store in
    which every slot records the prefix that wrote it (drafted tokens included), and checks
    each scheduled entry against that state. Verify steps (speculative decoding) too: the
    drafts a plan accepted join before its appended tokens, and tables are cut to
    `block_table_lens`.
    """

    def __init__(self, block_size: int,
                 model: Callable[[list[int]], int] = next_token) -> None:
        self.block_size, self.model = block_size, model
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.kv: dict[int, tuple[int, ...]] = {}

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """The model's next token for each sampled entry (no drafts)."""
        return {sid: t[0] for sid, t in self.verify(plan).items()}

    def verify(self, plan: StepPlan) -> dict[int, list[int]]:
        """For each sampled entry, the model's token at every verified position: after the
        last known token, then after each of its K drafts (K + 1 tokens)."""
        for sid in plan.freed_seq_ids:
            del self.tokens[sid], self.tables[sid]
        for new in plan.new_seqs:
            assert new.seq_id not in self.tokens
            self.tokens[new.seq_id] = list(new.token_ids)
            self.tables[new.seq_id] = []
        for sid, toks in plan.accepted_tokens.items():
            self.tokens[sid].extend(toks)
        for sid, token in plan.appended_tokens.items():
            self.tokens[sid].append(token)
        for sid, n in plan.block_table_lens.items():
            del self.tables[sid][n:]
        for s in plan.scheduled:
            self.tables[s.seq_id].extend(s.new_block_ids)
        assert len({s.seq_id for s in plan.scheduled}) == len(plan.scheduled)
        for s in plan.scheduled:  # reads: the cached prefix is this sequence's own
            known, table = self.tokens[s.seq_id], self.tables[s.seq_id]
            tokens = known + s.draft_token_ids
            end = s.num_computed_tokens + s.num_new_tokens
            assert s.num_new_tokens >= 1
            assert end <= len(tokens), "computing a token the runner does not know"
            assert len(table) == -(-end // self.block_size), "table must cover exactly"
            assert NULL_BLOCK not in table
            assert s.sample == (end == len(tokens)), "sample exactly at the last known token"
            for pos in range(s.num_computed_tokens):  # never a rejected draft
                assert self.kv.get(self._slot(table, pos)) == tuple(tokens[: pos + 1])
        out: dict[int, list[int]] = {}
        for s in plan.scheduled:  # writes
            known, table = self.tokens[s.seq_id], self.tables[s.seq_id]
            tokens = known + s.draft_token_ids
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                self.kv[self._slot(table, pos)] = tuple(tokens[: pos + 1])
            if s.sample:
                out[s.seq_id] = [self.model(tokens[: len(known) + i])
                                 for i in range(len(s.draft_token_ids) + 1)]
        return out


def check_consistent(sched: Scheduler, runner: MirrorRunner) -> None:
    """After a plan is applied, runner and scheduler agree on every live sequence."""
    assert set(runner.tokens) == {s.seq_id for s in sched.running}
    holders: dict[int, int] = {}
    for seq in sched.running:
        assert runner.tokens[seq.seq_id] == seq.token_ids
        assert runner.tables[seq.seq_id] == seq.block_ids
        for b in seq.block_ids:
            holders[b] = holders.get(b, 0) + 1
    bm = sched.block_manager
    assert bm.num_used == len(holders)
    for b, n in holders.items():
        assert bm.ref_count(b) == n
        if not bm.enable_prefix_caching:
            assert n == 1, f"block {b} shared by {n} live sequences"
    for seq in sched.waiting:
        assert seq.block_ids == [] and seq.num_computed_tokens == 0


@dataclass
class Req:
    arrive_step: int
    prompt: list[int]
    params: SamplingParams


def drive(
    cfg: SchedulerConfig, reqs: list[Req], *, seed: int = 0, abort_rate: float = 0.0
) -> tuple[dict[int, tuple[list[int], str]], Scheduler]:
    rng = random.Random(seed)
    sched = Scheduler(cfg)
    runner = MirrorRunner(cfg.block_size)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrive_step)
    results: dict[int, tuple[list[int], str]] = {}
    step = 0
    while order or sched.has_unfinished():
        while order and reqs[order[0]].arrive_step <= step:
            i = order.pop(0)
            sched.add(Sequence(i, f"req-{i}", list(reqs[i].prompt), reqs[i].params))
            sched.block_manager.check_integrity()
        if abort_rate and sched.has_unfinished() and rng.random() < abort_rate:
            victim = rng.choice([s.seq_id for s in sched.running + sched.waiting])
            seq = sched.get(victim)
            assert seq is not None and sched.abort(victim)
            results[victim] = (list(seq.output_token_ids), "cancelled")
            sched.block_manager.check_integrity()
        plan = sched.schedule()
        sched.block_manager.check_integrity()
        assert plan.num_tokens <= cfg.max_num_tokens
        assert len(sched.running) <= cfg.max_batch_size
        wire = pickle.loads(pickle.dumps(plan))  # what the other ranks receive
        assert wire == plan
        sampled = runner.execute(wire)
        check_consistent(sched, runner)
        for seq in sched.update(plan, sampled):
            assert seq.num_output_tokens >= 1
            if seq.finish_reason is not None:
                assert seq.finish_reason in ("stop", "length")
                results[seq.seq_id] = (list(seq.output_token_ids), seq.finish_reason)
        sched.block_manager.check_integrity()
        step += 1
        assert step < 20_000, "no progress"
    # One more plan delivers the last freed ids.
    plan = sched.schedule()
    runner.execute(plan)
    sched.update(plan, {})
    assert not plan.scheduled and runner.tokens == {}
    assert sched.block_manager.num_used == 0
    assert sched.block_manager.num_free == sched.block_manager.num_usable
    return results, sched


def random_requests(seed: int, n: int, *, shared_prefix: bool = False) -> list[Req]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
        if shared_prefix and rng.random() < 0.7:
            prompt = rng.choice(prefixes) + prompt[: rng.randint(0, 8)]
        params = SamplingParams(
            max_tokens=rng.randint(1, 25),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=(rng.randrange(1, VOCAB),) if rng.random() < 0.3 else (),
        )
        reqs.append(Req(rng.randint(0, 40), prompt, params))
    return reqs


def config(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(
        max_batch_size=64,
        max_num_tokens=512,
        block_size=4,
        num_blocks=1024,
        max_seq_len=64,
        eos_token_ids=(EOS,),
    )
    base.update(kw)
    if "max_batch_size" not in kw:  # the default batch must fit a small token budget
        base["max_batch_size"] = min(64, base["max_num_tokens"])  # type: ignore[type-var]
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def expected(req: Req) -> tuple[list[int], str]:
    """What any schedule must produce for `req`, computed without a scheduler."""
    return reference_output(req.prompt, req.params)


def reference_output(prompt: list[int], params: SamplingParams,
                     model: Callable[[list[int]], int] = next_token) -> tuple[list[int], str]:
    """Greedy decoding by `model` alone: the tokens and finish reason any schedule (with or
    without speculation) must reproduce."""
    tokens, out = list(prompt), []
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    while True:
        t = model(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop:
            return out, "stop"
        if len(out) >= params.max_tokens:
            return out, "length"


TIGHT = dict(max_batch_size=5, max_num_tokens=16, num_blocks=1 + 16)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "kw",
    [
        {},
        TIGHT,  # chunked prefill and preemption
        dict(max_batch_size=3, max_num_tokens=7, num_blocks=1 + 16, block_size=4),
        dict(max_batch_size=4, max_num_tokens=5, num_blocks=1 + 64, block_size=1),
        dict(max_batch_size=2, max_num_tokens=64, num_blocks=1 + 9, block_size=8),
        dict(TIGHT, enable_prefix_caching=True),
        dict(max_num_tokens=9, num_blocks=1 + 40, enable_prefix_caching=True),
        dict(TIGHT, max_prefill_tokens_while_decoding=3),
        dict(max_prefill_tokens_while_decoding=1, enable_prefix_caching=True),
        dict(TIGHT, max_prefill_tokens_while_waiting=2),
        dict(max_num_tokens=9, max_prefill_tokens_while_waiting=1, enable_prefix_caching=True),
    ],
    ids=["roomy", "tight", "tiny-budget", "block1", "big-blocks", "tight-cache", "cache",
         "tight-decode-cap", "decode-cap-1", "tight-wait-cap", "wait-cap-1"],
)
def test_random_workloads_match_the_reference(seed: int, kw: dict[str, object]) -> None:
    reqs = random_requests(seed, 40, shared_prefix=bool(kw.get("enable_prefix_caching")))
    results, _ = drive(config(**kw), reqs, seed=seed)
    assert results == {i: expected(r) for i, r in enumerate(reqs)}


def test_tight_pool_preempts_and_still_finishes_everything() -> None:
    reqs = random_requests(1, 40)
    results, sched = drive(config(**TIGHT), reqs)
    assert sched.stats().preemptions_total > 0
    assert len(results) == len(reqs)


def test_prefix_cache_saves_compute_and_keeps_outputs() -> None:
    reqs = random_requests(3, 40, shared_prefix=True)
    results, sched = drive(config(max_num_tokens=9, enable_prefix_caching=True), reqs)
    stats = sched.stats()
    assert stats.prefix_cache_hits_total > 0
    assert results == {i: expected(r) for i, r in enumerate(reqs)}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("caching", [False, True])
def test_random_aborts_free_everything(seed: int, caching: bool) -> None:
    reqs = random_requests(seed, 40, shared_prefix=caching)
    cfg = config(**dict(TIGHT, enable_prefix_caching=caching))
    results, _ = drive(cfg, reqs, seed=seed, abort_rate=0.08)
    assert len(results) == len(reqs)
    for i, (out, reason) in results.items():
        want_out, want_reason = expected(reqs[i])
        if reason == "cancelled":
            assert want_out[: len(out)] == out
        else:
            assert (out, reason) == (want_out, want_reason)


# ---- explicit cases ----------------------------------------------------------------------


def add(sched: Scheduler, sid: int, prompt: list[int], **params: object) -> Sequence:
    seq = Sequence(sid, f"req-{sid}", list(prompt), SamplingParams(**params))  # type: ignore[arg-type]
    sched.add(seq)
    sched.block_manager.check_integrity()
    return seq


def step(sched: Scheduler, tokens: dict[int, int] | None = None) -> tuple[StepPlan, list[Sequence]]:
    """One step; sampled rows get `tokens[seq_id]`, or 7."""
    plan = sched.schedule()
    sched.block_manager.check_integrity()
    tokens = tokens or {}
    sampled = {s.seq_id: tokens.get(s.seq_id, 7) for s in plan.scheduled if s.sample}
    out = sched.update(plan, sampled)
    sched.block_manager.check_integrity()
    return plan, out


def entries(plan: StepPlan) -> list[tuple[int, int, int, int, bool]]:
    """(seq_id, num_computed, num_new, number of new blocks, sample) per scheduled entry."""
    return [
        (s.seq_id, s.num_computed_tokens, s.num_new_tokens, len(s.new_block_ids), s.sample)
        for s in plan.scheduled
    ]


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_batch_size=0),
        dict(max_num_tokens=0),
        dict(max_batch_size=8, max_num_tokens=7),
        dict(block_size=0),
        dict(max_seq_len=0),
        dict(num_blocks=1),
        dict(eos_token_ids=[0]),
        dict(eos_token_ids=(-1,)),
        dict(max_prefill_tokens_while_decoding=0),
        dict(max_prefill_tokens_while_waiting=0),
        dict(max_prefill_tokens_while_waiting=True),
        dict(max_prefill_tokens_while_waiting=2.0),
    ],
)
def test_config_validation(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        config(**kw)


def test_add_rejects_what_can_never_be_served() -> None:
    sched = Scheduler(config(max_seq_len=16, block_size=4, num_blocks=1 + 3))
    with pytest.raises(ValueError, match="maximum context length of 16"):
        add(sched, 0, list(range(1, 11)), max_tokens=7)  # 17 > 16
    with pytest.raises(ValueError, match="KV blocks"):
        add(sched, 0, list(range(1, 11)), max_tokens=4)  # 13 tokens of KV > 12 slots
    add(sched, 0, list(range(1, 11)), max_tokens=3)  # 12 tokens of KV: exactly the pool
    with pytest.raises(ValueError, match="already"):
        add(sched, 0, [1], max_tokens=1)
    with pytest.raises(ValueError, match="at least one token"):
        add(sched, 1, [], max_tokens=1)
    assert sched.num_unfinished == 1
    # The one that fits exactly runs to completion alone.
    while sched.has_unfinished():
        step(sched)
    assert sched.block_manager.num_used == 0


def test_prompt_of_exactly_one_block() -> None:
    sched = Scheduler(config(block_size=4))
    seq = add(sched, 0, [1, 2, 3, 4], max_tokens=3)
    plan, out = step(sched, {0: 11})
    assert [(n.seq_id, n.token_ids) for n in plan.new_seqs] == [(0, [1, 2, 3, 4])]
    assert entries(plan) == [(0, 0, 4, 1, True)]
    assert out == [seq] and seq.output_token_ids == [11]
    plan, _ = step(sched, {0: 12})
    assert plan.appended_tokens == {0: 11} and not plan.new_seqs
    assert entries(plan) == [(0, 4, 1, 1, True)]  # position 4 opens the second block
    plan, out = step(sched, {0: 13})
    assert plan.appended_tokens == {0: 12}
    assert entries(plan) == [(0, 5, 1, 0, True)]
    assert out == [seq] and seq.finish_reason == "length" and seq.status is SeqStatus.FINISHED
    assert seq.output_token_ids == [11, 12, 13]
    assert sched.block_manager.num_used == 0
    plan, _ = step(sched)
    assert plan.freed_seq_ids == [0] and not plan.scheduled and not plan.appended_tokens


def test_long_prompt_is_chunked_over_steps() -> None:
    sched = Scheduler(config(block_size=4, max_num_tokens=4))
    seq = add(sched, 0, list(range(1, 11)), max_tokens=2)
    plan, out = step(sched)
    assert entries(plan) == [(0, 0, 4, 1, False)] and out == []
    plan, out = step(sched)
    assert entries(plan) == [(0, 4, 4, 1, False)] and not plan.new_seqs and out == []
    plan, out = step(sched, {0: 9})
    assert entries(plan) == [(0, 8, 2, 1, True)] and out == [seq]
    plan, out = step(sched)
    assert entries(plan) == [(0, 10, 1, 0, True)] and plan.appended_tokens == {0: 9}
    assert seq.finish_reason == "length"


def test_max_tokens_one_finishes_at_prefill() -> None:
    sched = Scheduler(config())
    seq = add(sched, 0, [1, 2, 3], max_tokens=1)
    _, out = step(sched, {0: 5})
    assert out == [seq] and seq.finish_reason == "length" and seq.output_token_ids == [5]
    plan, _ = step(sched)
    assert plan.freed_seq_ids == [0] and plan.appended_tokens == {} and not plan.scheduled
    assert not sched.has_unfinished()


def test_decodes_go_first_and_a_new_prompt_takes_the_rest_of_the_budget() -> None:
    sched = Scheduler(config(max_num_tokens=6))
    add(sched, 0, [1, 2], max_tokens=10)
    step(sched)
    add(sched, 1, list(range(1, 21)), max_tokens=2)
    plan, _ = step(sched)
    assert entries(plan) == [(0, 2, 1, 0, True), (1, 0, 5, 2, False)]
    plan, _ = step(sched)
    assert entries(plan) == [(0, 3, 1, 0, True), (1, 5, 5, 1, False)]
    plan, _ = step(sched)
    assert entries(plan) == [(0, 4, 1, 1, True), (1, 10, 5, 1, False)]


def test_prompt_chunks_shrink_while_others_decode() -> None:
    """While a sequence decodes, prompts get at most max_prefill_tokens_while_decoding tokens
    a step (its stall stays short); with nothing decoding, a prompt takes the budget."""
    sched = Scheduler(config(max_num_tokens=64, max_prefill_tokens_while_decoding=8))
    add(sched, 0, list(range(1, 21)), max_tokens=10)
    plan, _ = step(sched)
    assert entries(plan) == [(0, 0, 20, 5, True)]  # nothing decodes: the whole prompt
    add(sched, 1, list(range(1, 13)), max_tokens=2)
    add(sched, 2, list(range(1, 31)), max_tokens=2)
    plan, _ = step(sched)
    assert entries(plan) == [(0, 20, 1, 1, True), (1, 0, 8, 2, False)]
    plan, _ = step(sched)  # the running prompt's chunk comes out of the same 8
    assert entries(plan) == [(0, 21, 1, 0, True), (1, 8, 4, 1, True), (2, 0, 4, 1, False)]
    plan, _ = step(sched)
    assert [(e[0], e[2]) for e in entries(plan)] == [(0, 1), (1, 1), (2, 8)]
    sched.abort(0)
    sched.abort(1)
    plan, _ = step(sched)  # nobody decodes any more: the rest of the prompt at once
    assert [(e[0], e[2]) for e in entries(plan)] == [(2, 18)]


def test_batch_size_limit() -> None:
    sched = Scheduler(config(max_batch_size=2))
    for i in range(4):
        add(sched, i, [1, 2], max_tokens=3)
    plan, _ = step(sched)
    assert [s.seq_id for s in plan.scheduled] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2, 3]
    step(sched)
    step(sched)  # 0 and 1 finish here
    plan, _ = step(sched)
    assert plan.freed_seq_ids == [0, 1] and [n.seq_id for n in plan.new_seqs] == [2, 3]


def test_head_of_queue_is_not_overtaken() -> None:
    sched = Scheduler(config(block_size=4, num_blocks=1 + 4))
    add(sched, 0, list(range(1, 13)), max_tokens=4)  # 3 blocks now
    add(sched, 1, list(range(1, 9)), max_tokens=1)  # needs 2, 1 left
    add(sched, 2, [1, 2], max_tokens=1)  # would fit, but must wait its turn
    plan, _ = step(sched)
    assert [n.seq_id for n in plan.new_seqs] == [0]


def test_abort_waiting_and_running() -> None:
    sched = Scheduler(config(max_batch_size=1))
    running = add(sched, 0, [1, 2, 3], max_tokens=5)
    waiting = add(sched, 1, [1, 2, 3], max_tokens=5)
    step(sched)
    assert sched.block_manager.num_used == 1
    assert sched.abort(1)
    assert waiting.finish_reason == "cancelled" and waiting.status is SeqStatus.FINISHED
    assert sched.abort(0)
    assert running.finish_reason == "cancelled" and sched.block_manager.num_used == 0
    sched.block_manager.check_integrity()
    assert not sched.abort(0) and not sched.abort(99)
    assert not sched.has_unfinished()
    plan, _ = step(sched)
    # The runners only ever knew sequence 0; its pending token is dropped with it.
    assert plan.freed_seq_ids == [0] and plan.appended_tokens == {}


def test_abort_while_the_step_runs() -> None:
    sched = Scheduler(config())
    seq = add(sched, 0, [1, 2, 3], max_tokens=5)
    plan = sched.schedule()
    assert sched.abort(0) and sched.block_manager.num_used == 0
    assert sched.update(plan, {0: 4}) == []
    assert seq.output_token_ids == [] and seq.finish_reason == "cancelled"
    plan, _ = step(sched)
    assert plan.freed_seq_ids == [0] and not plan.scheduled


def test_preemption_by_recompute() -> None:
    sched = Scheduler(config(block_size=2, num_blocks=1 + 4))
    a = add(sched, 0, [1, 2, 3], max_tokens=5)
    b = add(sched, 1, [4, 5, 6], max_tokens=5)
    step(sched, {0: 10, 1: 20})
    step(sched, {0: 11, 1: 21})
    assert sched.block_manager.num_free == 0
    plan, _ = step(sched, {0: 12})  # a needs a third block: b, the newest, makes room
    assert plan.freed_seq_ids == [1] and plan.appended_tokens == {0: 11}
    assert entries(plan) == [(0, 4, 1, 1, True)] and not plan.new_seqs
    assert b.status is SeqStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert sched.stats().preemptions_total == 1
    plans = []
    while sched.has_unfinished():
        plans.append(step(sched, {0: 13, 1: 22})[0])
    [restart] = [n for p in plans for n in p.new_seqs]
    assert restart.seq_id == 1 and restart.token_ids == [4, 5, 6, 20, 21]
    [first] = [e for p in plans for e in entries(p) if e[0] == 1][:1]
    assert first == (1, 0, 5, 3, True)  # recomputed, and its last position samples
    assert a.output_token_ids == [10, 11, 12, 13, 13]
    assert b.output_token_ids == [20, 21, 22, 22, 22]
    assert sched.block_manager.num_used == 0


def test_a_sequence_can_preempt_itself() -> None:
    sched = Scheduler(config(block_size=2, num_blocks=1 + 5))
    add(sched, 0, [1, 2, 3, 4], max_tokens=3)
    add(sched, 1, [5, 6, 7, 8], max_tokens=3)
    step(sched)
    plan, _ = step(sched)  # both need a block, one is free: the older one gets it
    assert entries(plan) == [(0, 4, 1, 1, True)] and plan.freed_seq_ids == [1]
    while sched.has_unfinished():
        step(sched)
    assert sched.stats().preemptions_total == 1


def test_stop_tokens_eos_and_ignore_eos() -> None:
    sched = Scheduler(config(eos_token_ids=(0, 99)))
    eos = add(sched, 0, [1], max_tokens=5)
    ignore = add(sched, 1, [1], max_tokens=3, ignore_eos=True, stop_token_ids=(5,))
    custom = add(sched, 2, [1], max_tokens=5, stop_token_ids=(5,))
    last = add(sched, 3, [1], max_tokens=2)
    step(sched, {0: 3, 1: 0, 2: 3, 3: 3})
    step(sched, {0: 99, 1: 99, 2: 5, 3: 0})
    assert (eos.finish_reason, eos.output_token_ids) == ("stop", [3, 99])
    assert (custom.finish_reason, custom.output_token_ids) == ("stop", [3, 5])
    assert (last.finish_reason, last.output_token_ids) == ("stop", [3, 0])  # stop beats length
    assert ignore.finish_reason is None
    step(sched, {1: 5})
    assert (ignore.finish_reason, ignore.output_token_ids) == ("stop", [0, 99, 5])


def test_call_order_and_sampled_tokens_are_checked() -> None:
    sched = Scheduler(config())
    add(sched, 0, [1, 2], max_tokens=3)
    plan = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(plan, {})
    with pytest.raises(ValueError, match="did not sample"):
        sched.update(plan, {0: 1, 5: 1})
    with pytest.raises(RuntimeError):
        sched.update(StepPlan(step_id=plan.step_id), {})
    sched.update(plan, {0: 1})
    with pytest.raises(RuntimeError):
        sched.update(plan, {0: 1})


def test_stats() -> None:
    sched = Scheduler(config(max_batch_size=1, block_size=4))
    add(sched, 0, [1, 2, 3, 4, 5], max_tokens=2)
    add(sched, 1, [1, 2], max_tokens=2)
    plan, _ = step(sched)
    stats = sched.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (1, 1, 2)
    assert (stats.tokens_last_step, stats.steps_total) == (plan.num_tokens, 1) == (5, 1)
    assert (stats.kv_blocks_total, stats.prompt_tokens_total) == (1023, 5)
    while sched.has_unfinished():
        step(sched)
    stats = sched.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (7, 4)


def test_prefix_cache_hits_share_full_blocks() -> None:
    sched = Scheduler(config(block_size=4, enable_prefix_caching=True))
    prompt = list(range(1, 11))
    add(sched, 0, prompt, max_tokens=4)
    plan0, _ = step(sched)
    add(sched, 1, [*prompt[:8], 30, 31], max_tokens=2)
    plan, _ = step(sched)
    shared = plan0.scheduled[0].new_block_ids[:2]
    assert entries(plan)[1] == (1, 8, 2, 3, True)
    assert plan.scheduled[1].new_block_ids[:2] == shared
    assert [sched.block_manager.ref_count(b) for b in shared] == [2, 2]
    assert sched.stats().prefix_cache_hits_total == 8
    assert sched.stats().kv_blocks_cached == 0  # every cached block is held
    while sched.has_unfinished():
        step(sched)
    # Nothing is in use once both finished; their full blocks stay in the prefix cache.
    stats = sched.stats()
    assert (stats.kv_blocks_used, stats.kv_blocks_cached) == (0, sched.block_manager.num_cached)
    assert stats.kv_blocks_cached >= 2
    # Freed blocks stay cached; a prompt that is all cache still computes its last block.
    add(sched, 2, prompt[:8], max_tokens=1)
    plan, _ = step(sched)
    assert entries(plan) == [(2, 4, 4, 2, True)]
    assert plan.scheduled[0].new_block_ids[0] == shared[0]


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = Scheduler(config(block_size=2, num_blocks=1 + 4, max_num_tokens=3))
    add(sched, 0, [1, 2, 3], max_tokens=5)
    add(sched, 1, [4], max_tokens=5)
    step(sched)
    step(sched)
    step(sched)
    plan, _ = step(sched)  # 1 needs a block and is the newest: it yields its own
    assert plan.freed_seq_ids == [1] and not plan.new_seqs
    assert sched.block_manager.num_free == 1  # room for its first chunk, but not this step
    while sched.has_unfinished() and not plan.new_seqs:
        plan, _ = step(sched)
    assert [(n.seq_id, n.token_ids) for n in plan.new_seqs] == [(1, [4, 7, 7])]
