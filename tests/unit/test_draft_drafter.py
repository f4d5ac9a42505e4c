"""The draft-engine drafter (runtime/executors/draft.py) over a pure-Python runner: its
state per sequence (catch-up, rollback to the longest common prefix after rejections,
forget), batching, running out of draft blocks, the Drafter protocol, and the scheduler
driven with it (outputs those of one-token decoding; all drafts accepted when the draft
is the target's own model, fewer when it is another)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from contract.speculative import Speculative
from runtime.core.plan import NULL_BLOCK, StepPlan
from runtime.core.spec import Drafter, NgramDrafter
from runtime.executors.draft import DraftEngineDrafter, common_prefix
from runtime.executors.runner import SeqState
from tests.unit.test_spec import VOCAB, config, expected, next_token, requests, run

Model = Callable[[list[int]], int]


class FakeDraftRunner:
    """What the drafter uses of a ModelRunner (`seqs`, `block_size`, `execute`), in pure
    Python: every KV slot records the prefix that wrote it, each entry's reads are checked
    against its own tokens (never a stale or foreign position), and a sampled row is a
    one-hot of `model` at its last position."""

    def __init__(self, block_size: int, model: Model) -> None:
        self.block_size, self.model = block_size, model
        self.token_bucket, self.pad_from = 16, 4
        self.seqs: dict[int, SeqState] = {}
        self.kv: dict[int, tuple[int, ...]] = {}
        self.steps: list[list[tuple[int, int, int]]] = []  # (seq, start, n) per step

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: StepPlan) -> tuple[list[int], torch.Tensor | None]:
        ids, rows = [], []
        self.steps.append([(s.seq_id, s.num_computed_tokens, s.num_new_tokens)
                           for s in plan.scheduled])
        for s in plan.scheduled:
            state = self.seqs[s.seq_id]
            tokens, table = state.token_ids, state.block_table
            end = s.num_computed_tokens + s.num_new_tokens
            assert end <= len(tokens) and len(table) * self.block_size >= end
            assert NULL_BLOCK not in table
            for pos in range(s.num_computed_tokens):
                assert self.kv.get(self._slot(table, pos)) == tuple(tokens[:pos + 1]), pos
            for pos in range(s.num_computed_tokens, end):
                self.kv[self._slot(table, pos)] = tuple(tokens[:pos + 1])
            if s.sample:
                ids.append(s.seq_id)
                row = torch.zeros(VOCAB)
                row[self.model(tokens[:end])] = 1.0
                rows.append(row)
        return ids, torch.stack(rows) if rows else None


def greedy(model: Model, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out.append(model(out))
    return out[len(tokens):]


def drafter(model: Model = next_token, k: int = 4, blocks: int = 64, block_size: int = 4,
            max_num_tokens: int = 64) -> DraftEngineDrafter:
    runner = FakeDraftRunner(block_size, model)
    return DraftEngineDrafter(runner, k, blocks, max_num_tokens, keep_logits=True)  # type: ignore[arg-type]


def test_both_drafters_satisfy_the_protocol() -> None:
    assert isinstance(NgramDrafter(4), Drafter)
    d = drafter()
    assert isinstance(d, Drafter)
    assert d.runner.pad_from == 16  # catch-up chunks of up to a bucket are not padded


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 3) == 3
    assert common_prefix([1, 2, 3], [1, 9, 3], 3) == 1
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix([], [1], 5) == 0


def test_drafts_are_the_draft_models_greedy_continuation_batched() -> None:
    d = drafter(k=4)
    a, b = [1, 2, 3, 4, 5, 6, 7], [3, 3, 9]
    d.prepare([(0, a, 4), (1, b, 2)])
    assert d.propose(a, 4, 0) == greedy(next_token, a, 4)
    assert d.propose(a, 2, 0) == greedy(next_token, a, 2)  # cut to the step's k
    assert d.propose(b, 4, 1) == greedy(next_token, b, 2)  # its own bound
    assert d.propose(a, 4, 7) == []  # not prepared
    assert d.propose(a + [1], 4, 0) == []  # prepared for other tokens
    runner = d.runner
    # one catch-up step for both, then K - 1 = 3 decode steps (the second only in the first)
    assert runner.steps[0] == [(0, 0, 7), (1, 0, 3)]  # type: ignore[attr-defined]
    assert runner.steps[1:] == [[(0, 7, 1), (1, 3, 1)], [(0, 8, 1)], [(0, 9, 1)]]  # type: ignore[attr-defined]
    assert d.computed(0) == 7 + 3 and d.computed(1) == 3 + 1
    q = d.draft_logits(0)
    assert q is not None and q.shape == (4, VOCAB)
    assert q.argmax(-1).tolist() == greedy(next_token, a, 4)


def test_catch_up_after_partial_acceptance_rolls_back_the_rejected_positions() -> None:
    other: Model = lambda t: (next_token(t) + (1 if len(t) % 3 == 0 else 0)) % VOCAB  # noqa: E731
    d = drafter(other, k=4)
    tokens = [1, 2, 3, 4, 5]
    for _ in range(12):
        d.prepare([(0, tokens, 4)])
        drafts = d.propose(tokens, 4, 0)
        assert drafts == greedy(other, tokens, 4)
        # the target (next_token) keeps the drafts it agrees with, then its own token
        want = greedy(next_token, tokens, 5)
        a = next(i for i in range(5) if i == 4 or drafts[i] != want[i])
        before = len(d.runner.steps)  # type: ignore[attr-defined]
        tokens = tokens + want[:a + 1]
        d.prepare([(0, tokens, 4)])
        first = d.runner.steps[before]  # type: ignore[attr-defined]
        # catch-up starts right after the last accepted draft (the rejected ones are gone)
        start = len(tokens) - a - 1 + min(a, 3)  # at most K - 1 drafts had KV
        assert first == [(0, start, len(tokens) - start)]
        assert d.blocks.num_used == d.blocks.blocks_needed(len(tokens) + 3)
        d.blocks.check_integrity()


def test_forget_frees_everything_and_a_full_cache_evicts_idle_sequences() -> None:
    d = drafter(blocks=1 + 6, block_size=4)  # 24 tokens of draft cache
    d.prepare([(0, [1] * 9, 4), (1, [2] * 5, 4)])  # 12 + 8 positions: 3 + 2 blocks
    assert d.blocks.num_used == 5
    d.prepare([(2, [3] * 13, 4)])  # 16 positions: 4 blocks; 0 and 1 are idle: evicted
    assert set(d.runner.seqs) == {2} and d.propose([3] * 13, 4, 2)
    d.prepare([(2, [3] * 13, 4), (3, [4] * 9, 4)])  # 4 + 3 blocks > 6: 3 cannot draft now
    assert d.propose([4] * 9, 4, 3) == [] and d.propose([3] * 13, 4, 2)
    for sid in (2, 3):
        d.forget(sid)
    d.forget(99)  # unknown: nothing
    assert d.blocks.num_used == 0 and not d.runner.seqs
    d.blocks.check_integrity()


def test_long_catch_up_is_chunked_within_the_draft_step_bound() -> None:
    d = drafter(k=3, max_num_tokens=8, blocks=64)
    a, b = list(range(1, 11)) + [1, 2], [5, 6, 7, 8, 9]
    d.prepare([(0, a, 3), (1, b, 3)])
    steps = d.runner.steps  # type: ignore[attr-defined]
    assert all(sum(n for _, _, n in s) <= 8 for s in steps)
    assert d.propose(a, 3, 0) == greedy(next_token, a, 3)
    assert d.propose(b, 3, 1) == greedy(next_token, b, 3)


@pytest.mark.parametrize("same", [True, False], ids=["same-model", "other-model"])
@pytest.mark.parametrize("kw", [{}, dict(max_num_tokens=10, num_blocks=1 + 24,
                                         enable_prefix_caching=True)],
                         ids=["roomy", "tight-cache"])
def test_scheduler_with_a_draft_engine_keeps_one_token_outputs(
        same: bool, kw: dict[str, object]) -> None:
    other: Model = lambda t: (next_token(t) + (len(t) % 4 == 0)) % VOCAB  # noqa: E731
    d = drafter(next_token if same else other, k=4, blocks=1 + 200)
    cfg = config(speculative=Speculative("draft", 4, engine="x"), **kw)
    reqs = requests(5, 20)
    results, sched = run(cfg, reqs, drafter=d)
    assert results == {i: expected(p, sp) for i, (p, sp) in enumerate(reqs)}
    stats = sched.stats()
    assert stats.spec_draft_tokens_total > 0
    if same:
        assert stats.spec_accepted_tokens_total == stats.spec_draft_tokens_total
    else:
        assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    assert d.blocks.num_used == 0 and not d.runner.seqs  # every sequence forgotten


def test_a_draft_setting_needs_its_drafter() -> None:
    from runtime.core.scheduler import Scheduler

    with pytest.raises(ValueError, match="draft engine"):
        Scheduler(config(speculative=Speculative("draft", 4, engine="x")))


def test_parse_draft_settings() -> None:
    assert Speculative.parse("draft:/e/x") == Speculative("draft", 4, engine="/e/x")
    assert Speculative.parse("draft:/e/x:6") == Speculative("draft", 6, engine="/e/x")
    assert Speculative.parse("draft:C:/a:b:3") == Speculative("draft", 3, engine="C:/a:b")
    s = Speculative("draft", 5, engine="/e", engine_id="abc")
    assert Speculative.from_json(s.to_json()) == s and str(s) == "draft:/e:5"
    for bad in ("draft", "draft:", "draft:/e:0", "draft:/e:16"):
        with pytest.raises(ValueError):
            Speculative.parse(bad)
    with pytest.raises(ValueError):
        Speculative("ngram", 4, engine="/e")
