"""Speculative decoding on rank 0: the n-gram drafter, the scheduler's verify entries and
their rollback (computed tokens, blocks, prefix cache), greedy acceptance, and the plan's
new fields on the wire."""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from contract.speculative import Speculative
from runtime.core.plan import ScheduledSeq, StepPlan
from runtime.core.scheduler import Scheduler, SchedulerConfig
from runtime.core.sequence import Sequence
from runtime.core.spec import Drafter, NgramDrafter, accept_greedy, speculable
from runtime.core.spec_policy import MAX_BACKOFF, MIN_BACKOFF, AdaptivePolicy, SpecCost
from runtime.core.types import GuidedSpec, SamplingParams
from runtime.dist.wire import plan_from_wire, plan_to_wire
from tests.unit.test_scheduler import MirrorRunner, reference_output

EOS = 0
VOCAB = 12


def next_token(tokens: list[int]) -> int:
    """A deterministic 'model' that repeats itself: the next token depends on the last two
    only, so outputs fall into cycles and prompt lookup drafts get accepted."""
    digest = hashlib.blake2b(array("q", tokens[-2:]).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


# ---- the drafter ------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_match() -> None:
    d = NgramDrafter(3)
    # last 3 tokens (1 2 3) occurred at the start: propose what followed them
    assert d.propose([1, 2, 3, 9, 8, 7, 5, 1, 2, 3]) == [9, 8, 7]
    assert d.propose([1, 2, 3, 9, 8, 7, 5, 1, 2, 3], k=2) == [9, 8]
    # no 3-gram or 2-gram match: falls back to the last token alone (4 -> 6)
    assert d.propose([4, 6, 5, 5, 7, 4]) == [6, 5, 5]
    assert d.propose([1, 2, 3]) == []  # nothing repeats
    assert d.propose([5]) == []
    assert d.propose([1, 2, 1, 2], k=0) == []


def test_ngram_prefers_the_most_recent_match_with_k_tokens_after_it() -> None:
    d = NgramDrafter(2)
    # 7 8 occurs twice before the end: the later one (followed by 3 4) wins
    assert d.propose([7, 8, 1, 1, 7, 8, 3, 4, 0, 7, 8]) == [3, 4]
    # the most recent match is too close to the end for K tokens: the earliest serves
    assert d.propose([5, 5, 5, 5, 5], k=3) == [5, 5]  # n=3 at 1: 1 token follows, at 0: 2
    seq = [3, 1, 2, 9, 9, 9, 3, 1, 2]
    assert d.propose(seq, k=4) == [9, 9, 9, 3]


def test_ngram_matches_whole_tokens_only() -> None:
    # 256 = bytes 00 01 00 00; a byte-level match straddling two ids must not count
    d = NgramDrafter(2, n_max=1)
    assert d.propose([1, 256, 7, 1]) == [256, 7]
    assert d.propose([0x01000000, 0, 5, 1]) == []


def test_accept_greedy_and_speculable() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 6]) == 3
    assert accept_greedy([4, 5, 6], [4, 9, 6]) == 1
    assert accept_greedy([4, 5, 6], [1, 5, 6]) == 0
    # acceptance is lossless for every kind (tests/unit/test_spec_accept.py)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
                   SamplingParams(temperature=0.0, logprobs=1),
                   SamplingParams(temperature=0.0, n=2),
                   SamplingParams(temperature=0.0, repetition_penalty=1.1),
                   SamplingParams(temperature=0.0, guided=GuidedSpec("json_object")),
                   SamplingParams(temperature=0.0, min_tokens=3)):
        assert speculable(params, 2, True)


def test_speculative_config_parses_and_validates() -> None:
    assert Speculative.parse("off") is None
    assert Speculative.parse("ngram") == Speculative("ngram", 4)
    assert Speculative.parse("ngram:7") == Speculative("ngram", 7)
    assert str(Speculative("ngram", 3)) == "ngram:3"
    assert Speculative.from_json(Speculative("ngram", 3).to_json()) == Speculative("ngram", 3)
    for bad in ("ngram:0", "ngram:x", "draft", "ngram:99"):
        with pytest.raises(ValueError):
            Speculative.parse(bad)


# ---- the scheduler with a mirror runner -------------------------------------------------


def run(cfg: SchedulerConfig, reqs: list[tuple[list[int], SamplingParams]], *, seed: int = 0,
        drafter: Drafter | None = None) -> tuple[dict[int, tuple[list[int], str]], Scheduler]:
    """Drive the scheduler to the end; acceptance as the engine does it."""
    rng = random.Random(seed)
    sched, mirror = Scheduler(cfg, drafter), MirrorRunner(cfg.block_size, next_token)
    pending = list(enumerate(reqs))
    results: dict[int, tuple[list[int], str]] = {}
    steps = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                i, (prompt, params) = pending.pop(0)
                sched.add(Sequence(i, f"r{i}", list(prompt), params))
        plan = sched.schedule()
        sched.block_manager.check_integrity()
        assert plan.num_tokens <= cfg.max_num_tokens
        assert (sum(s.sample + s.prompt_logits for s in plan.scheduled) + plan.num_draft_rows
                <= cfg.logit_rows)
        wire = plan_from_wire(plan_to_wire(plan))
        assert wire == plan
        targets = mirror.verify(wire)
        sampled, accepted = {}, {}
        for s in plan.scheduled:
            if not s.sample:
                continue
            t = targets[s.seq_id]
            a = accept_greedy(s.draft_token_ids, t)
            sampled[s.seq_id] = t[a]
            if s.draft_token_ids:
                accepted[s.seq_id] = s.draft_token_ids[:a]
        for seq in sched.update(plan, sampled, None, accepted):
            if seq.finish_reason is not None:
                results[seq.seq_id] = (list(seq.output_token_ids), seq.finish_reason)
        sched.block_manager.check_integrity()
        for seq in sched.running:  # no block is held beyond the computed tokens
            assert len(seq.block_ids) == sched.block_manager.blocks_needed(
                seq.num_computed_tokens)
        steps += 1
        assert steps < 20_000
    plan = sched.schedule()
    mirror.execute(plan)
    sched.update(plan, {})
    assert sched.block_manager.num_used == 0
    return results, sched


def expected(prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    return reference_output(prompt, params, next_token)


def requests(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 30), temperature=0.0 if rng.random() < 0.8 else 0.5,
            ignore_eos=rng.random() < 0.7,
            stop_token_ids=(rng.randrange(1, VOCAB),) if rng.random() < 0.3 else ())
        out.append((prompt, params))
    return out


def config(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(max_batch_size=8, max_num_tokens=64, block_size=4,
                                   num_blocks=1 + 200, max_seq_len=64, eos_token_ids=(EOS,),
                                   speculative=Speculative("ngram", 4),
                                   spec_max_batch_size=8)  # verify at every batch size
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kw", [
    {},
    dict(enable_prefix_caching=True),
    dict(max_num_tokens=10, num_blocks=1 + 24, enable_prefix_caching=True),  # preemption
    dict(block_size=1, speculative=Speculative("ngram", 7)),
    dict(max_batch_size=4, max_num_tokens=12, max_logit_rows=6),
    dict(spec_adaptive=False),  # K whenever the drafter matches
    dict(max_batch_size=4, spec_max_batch_size=2),  # drafts only while few decode
], ids=["roomy", "cache", "tight-cache", "block1", "rows", "fixed-k", "adaptive-costly"])
def test_outputs_equal_one_token_decoding(seed: int, kw: dict[str, object]) -> None:
    reqs = requests(seed, 30)
    results, sched = run(config(**kw), reqs, seed=seed)
    assert results == {i: expected(p, sp) for i, (p, sp) in enumerate(reqs)}
    stats = sched.stats()
    assert stats.spec_draft_tokens_total > 0
    assert 0 <= stats.spec_accepted_tokens_total <= stats.spec_draft_tokens_total
    assert stats.spec_accepted_tokens_total > 0 or "spec_max_batch_size" in kw
    # vLLM's counters agree: per-position counts sum to the accepted tokens and never grow
    # down the chain; a verify step drafts 1..K tokens
    per_pos = stats.spec_accepted_per_pos
    assert sum(per_pos) == stats.spec_accepted_tokens_total
    assert list(per_pos) == sorted(per_pos, reverse=True)
    k = (kw.get("speculative") or Speculative("ngram", 4)).num_tokens  # type: ignore[attr-defined]
    assert stats.spec_drafts_total <= stats.spec_draft_tokens_total <= k * stats.spec_drafts_total


def test_without_a_drafter_nothing_is_drafted() -> None:
    reqs = requests(0, 10)
    results, sched = run(config(speculative=None), reqs)
    assert results == {i: expected(p, sp) for i, (p, sp) in enumerate(reqs)}
    assert sched.stats().spec_draft_tokens_total == 0


# ---- explicit rollback cases ------------------------------------------------------------

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prefill(sched: Scheduler, prompt: list[int], first: int, **params: object) -> Sequence:
    seq = Sequence(0, "r0", list(prompt), SamplingParams(**{**GREEDY, **params}))  # type: ignore[arg-type]
    sched.add(seq)
    plan = sched.schedule()
    sched.update(plan, {0: first})
    return seq


def test_rejected_drafts_free_their_blocks_and_runners_cut_their_tables() -> None:
    sched = Scheduler(config(block_size=4, speculative=Speculative("ngram", 4)))
    bm = sched.block_manager
    # prompt 1 2 3 4 5 6 + sampled 1: the drafter matches "1" and proposes 2 3 4 5
    seq = prefill(sched, [1, 2, 3, 4, 5, 6], 1, max_tokens=20)
    assert seq.block_ids and len(seq.block_ids) == 2  # 6 prompt tokens
    plan = sched.schedule()
    (entry,) = plan.scheduled
    assert entry.draft_token_ids == [2, 3, 4, 5]
    assert (entry.num_computed_tokens, entry.num_new_tokens, entry.sample) == (6, 5, True)
    assert len(entry.new_block_ids) == 1 and len(seq.block_ids) == 3  # positions 6..10
    used = bm.num_used
    # the target agrees with the first draft only: 1 accepted, then its own 9
    sched.update(plan, {0: 9}, None, {0: [2]})
    assert seq.output_token_ids == [1, 2, 9]
    assert seq.num_computed_tokens == 8  # the prompt, the 1 and the accepted 2
    assert len(seq.block_ids) == 2 and bm.num_used == used - 1  # block 3 held only rejects
    bm.check_integrity()
    nxt = sched.schedule()
    assert nxt.accepted_tokens == {0: [2]} and nxt.appended_tokens == {0: 9}
    assert nxt.block_table_lens == {0: 2}
    (e2,) = nxt.scheduled
    assert e2.num_computed_tokens == 8


def test_all_accepted_keeps_the_blocks_and_appends_the_bonus() -> None:
    sched = Scheduler(config(block_size=4, speculative=Speculative("ngram", 4)))
    seq = prefill(sched, [1, 2, 3, 4, 5, 6], 1, max_tokens=20)
    plan = sched.schedule()
    sched.update(plan, {0: 6}, None, {0: [2, 3, 4, 5]})
    assert seq.output_token_ids == [1, 2, 3, 4, 5, 6]
    assert seq.num_computed_tokens == 11 and len(seq.block_ids) == 3
    nxt = sched.schedule()
    assert nxt.block_table_lens == {} and nxt.accepted_tokens == {0: [2, 3, 4, 5]}


def test_prefix_cache_never_registers_a_block_with_a_rejected_draft() -> None:
    sched = Scheduler(config(block_size=4, enable_prefix_caching=True,
                             speculative=Speculative("ngram", 4)))
    bm = sched.block_manager
    # prompt of 3 + first token 1: the verify step computes positions 3..6, block 0's last
    # slot and block 1's first three
    seq = prefill(sched, [1, 2, 3], 1, max_tokens=20)
    assert bm.num_cached == 0
    plan = sched.schedule()
    (entry,) = plan.scheduled
    assert entry.draft_token_ids == [2, 3, 1]  # the whole sequence after the first "1"
    # nothing accepted: block 1 held only rejected drafts (freed); block 0 is full of the
    # prompt and the first token (registered)
    sched.update(plan, {0: 8}, None, {0: []})
    assert seq.num_computed_tokens == 4  # block 0 full of prompt + first token: registered
    assert bm.num_cached == 1
    assert bm.cached_block(seq.block_hashes[0], [1, 2, 3, 1]) == seq.block_ids[0]
    plan = sched.schedule()
    sched.update(plan, {0: 5}, None, {0: []} if plan.scheduled[0].draft_token_ids else None)
    bm.check_integrity()
    # whatever is registered holds exactly the sequence's own tokens
    tokens = seq.token_ids
    for i, h in enumerate(seq.block_hashes[:seq.num_registered_blocks]):
        assert bm.cached_block(h, tokens[4 * i:4 * i + 4]) == seq.block_ids[i]
    assert seq.num_registered_blocks == seq.num_computed_tokens // 4


def test_stop_token_among_accepted_drafts_ends_the_sequence_there() -> None:
    sched = Scheduler(config(block_size=4, speculative=Speculative("ngram", 4)))
    seq = prefill(sched, [1, 2, 3, 4, 5, 6], 1, max_tokens=20, stop_token_ids=(3,))
    plan = sched.schedule()
    assert plan.scheduled[0].draft_token_ids == [2, 3, 4, 5]
    out = sched.update(plan, {0: 6}, None, {0: [2, 3, 4, 5]})
    assert out == [seq] and seq.finish_reason == "stop"
    assert seq.output_token_ids == [1, 2, 3]
    assert sched.block_manager.num_used == 0 and not sched.has_unfinished()
    sched.block_manager.check_integrity()
    nxt = sched.schedule()
    assert nxt.freed_seq_ids == [0] and nxt.accepted_tokens == {} and nxt.appended_tokens == {}


def test_drafts_stop_one_short_of_max_tokens() -> None:
    sched = Scheduler(config(block_size=4, speculative=Speculative("ngram", 4)))
    prefill(sched, [1, 2, 3, 4, 5, 6], 1, max_tokens=3)
    plan = sched.schedule()
    # 2 tokens left to produce: 1 draft + the token after it
    assert plan.scheduled[0].draft_token_ids == [2]
    (seq,) = sched.update(plan, {0: 3}, None, {0: [2]})
    assert seq.output_token_ids == [1, 2, 3] and seq.finish_reason == "length"


def test_sampled_requests_draft_but_not_without_free_blocks() -> None:
    sched = Scheduler(config(speculative=Speculative("ngram", 4)))
    prefill(sched, [1, 2, 3, 4, 5, 6], 1, max_tokens=20, temperature=0.8)
    plan = sched.schedule()
    assert plan.scheduled[0].draft_token_ids == [2, 3, 4, 5]
    # one usable block beyond the prompt's two... none: the decode fits, drafts do not
    sched = Scheduler(config(block_size=4, num_blocks=1 + 2, max_seq_len=8))
    prefill(sched, [1, 2, 3, 4, 5, 6], 1, max_tokens=2)
    plan = sched.schedule()
    assert plan.scheduled[0].num_new_tokens == 1 and plan.scheduled[0].draft_token_ids == []


def test_update_checks_accepted_tokens() -> None:
    sched = Scheduler(config(block_size=4))
    prefill(sched, [1, 2, 3, 4, 5, 6], 1, max_tokens=20)
    plan = sched.schedule()
    with pytest.raises(ValueError, match="not a prefix"):
        sched.update(plan, {0: 6}, None, {0: [3]})


def test_runner_inputs_for_a_verify_entry() -> None:
    from runtime.executors.runner import SeqState, prepare_inputs

    state = SeqState([10, 11, 12, 13, 14], [1, 2])
    entry = ScheduledSeq(0, 4, 4, [], True, 0, [20, 21, 22])
    args, sampled = prepare_inputs([(state, entry)], 4)
    ids, pos, slots, *_, logits_index = args
    assert ids.tolist() == [14, 20, 21, 22] and pos.tolist() == [4, 5, 6, 7]
    assert slots.tolist() == [8, 9, 10, 11]
    # the sampled row (after the last draft) first, then the rows before each draft
    assert logits_index.tolist() == [3, 0, 1, 2] and sampled == [0]
    assert state.token_ids == [10, 11, 12, 13, 14]  # drafts are not the runner's tokens


def test_the_runner_pads_prompt_steps_but_not_verify_steps() -> None:
    import torch

    from runtime.core.plan import NewSeq
    from runtime.executors.runner import ModelRunner

    seen: list[int] = []

    def step_fn(ids: torch.Tensor, *rest: object) -> torch.Tensor:
        seen.append(ids.shape[0])
        logits_index = rest[-3]
        assert isinstance(logits_index, torch.Tensor)
        return torch.zeros(logits_index.shape[0], 8)

    runner = ModelRunner(step_fn, torch.zeros(1, 2, 8, 4, 1, 2), 4, token_bucket=16,
                         max_tokens=64)
    # a 7-token prompt chunk: padded to the bucket
    runner.execute(StepPlan(0, new_seqs=[NewSeq(0, [1, 2, 3, 4, 5, 6, 7])],
                            scheduled=[ScheduledSeq(0, 0, 7, [1, 2], True)]))
    # a verify step of 1 + 5 tokens: its exact shape, and a logits row per draft
    sampled, logits = runner.execute(StepPlan(1, appended_tokens={0: 9}, scheduled=[
        ScheduledSeq(0, 7, 6, [3, 4], True, 0, [4, 5, 6, 7, 8])]))
    assert seen == [16, 6]
    assert sampled == [0] and logits is not None and logits.shape[0] == 6


# ---- the adaptive policy ----------------------------------------------------------------

COST = SpecCost(token=0.03, verify=0.1)


def test_cost_model_drafts_more_when_acceptance_is_high_and_none_when_it_does_not_pay() -> None:
    assert COST.best_k(1.0, 4, 1) == 4
    assert COST.best_k(0.95, 8, 1) == 8
    assert 0 < COST.best_k(0.5, 8, 1) < 8
    assert COST.best_k(0.02, 4, 1) == 0
    # a step of many sequences makes every drafted token cost more of everyone's time
    ks = [COST.best_k(0.5, 8, b) for b in (1, 4, 16, 64)]
    assert ks == sorted(ks, reverse=True) and ks[-1] < ks[0]
    assert COST.best_k(0.3, 4, 64) == 0


def test_k_shrinks_on_rejection_backs_off_probes_and_grows_back() -> None:
    policy = AdaptivePolicy(COST, max_batch_size=8)
    assert policy.k_for(1, 4, 1) == 4  # optimistic start: copying pays from the first step
    policy.observe(1, 4, 0)
    ks = []
    while not ks or ks[-1]:  # every draft rejected, until it stops drafting
        ks.append(policy.k_for(1, 4, 1))
        if ks[-1]:
            policy.observe(1, ks[-1], 0)
        assert len(ks) < 10
    assert ks == sorted(ks, reverse=True) and 0 < ks[-2] < 4  # shrinks, then stops
    assert policy.backoffs_total == 1
    # a pause of MIN_BACKOFF decode steps without drafts, then a one-token probe
    st = policy.states[1]
    for _ in range(st.pause - 1):
        assert policy.k_for(1, 4, 1) == 0
    assert policy.k_for(1, 4, 1) == 1
    policy.observe(1, 1, 0)  # rejected: the next pause is twice as long
    assert st.backoff == 2 * MIN_BACKOFF and st.pause == 2 * MIN_BACKOFF
    for _ in range(2 * MIN_BACKOFF - 1):
        assert policy.k_for(1, 4, 1) == 0
    assert policy.k_for(1, 4, 1) == 1
    policy.observe(1, 1, 1)  # accepted: it copies again; K grows back with acceptance
    assert st.backoff == MIN_BACKOFF
    grown = []
    for _ in range(12):
        k = policy.k_for(1, 4, 1)
        grown.append(k)
        if k:
            policy.observe(1, k, k)
    assert grown[-1] == 4 and grown == sorted(grown)
    policy.forget(1)
    assert 1 not in policy.states


def test_backoff_is_bounded_and_an_empty_probe_is_not_a_failure() -> None:
    policy = AdaptivePolicy(COST, max_batch_size=8)
    st = None
    verified = 0
    for _ in range(200):  # free generation: nothing is ever accepted
        k = policy.k_for(2, 4, 1)
        st = policy.states[2]
        if k:
            verified += 1
            policy.observe(2, k, 0)
    assert st is not None and st.backoff == MAX_BACKOFF
    assert verified <= 12  # a few steps to learn, then a probe every 8, 16, ... 64 steps
    while policy.k_for(2, 4, 1) == 0:
        pass
    policy.no_draft(2)  # the drafter had nothing: no evidence either way
    assert not st.probing and st.backoff == MAX_BACKOFF


def test_no_drafting_above_the_batch_threshold() -> None:
    policy = AdaptivePolicy(COST, max_batch_size=4)
    assert policy.k_for(1, 4, 4) > 0
    assert policy.k_for(1, 4, 5) == 0
    # through the scheduler: three decoding sequences, threshold 2 -> no drafts; 3 -> drafts
    for limit, want in ((2, False), (3, True)):
        sched = Scheduler(config(block_size=4, spec_max_batch_size=limit))
        for i in range(3):
            sched.add(Sequence(i, f"r{i}", [1, 2, 3, 4, 5, 6], SamplingParams(**GREEDY)))  # type: ignore[arg-type]
        plan = sched.schedule()
        sched.update(plan, {s.seq_id: 1 for s in plan.scheduled})
        plan = sched.schedule()
        assert len(plan.scheduled) == 3
        assert any(s.draft_token_ids for s in plan.scheduled) is want
