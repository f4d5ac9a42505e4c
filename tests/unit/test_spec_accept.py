"""Speculative acceptance for every request kind (runtime/core/spec.py, RequestTable.verify),
through the real engine loop (LLMEngine) over a runner that returns logits from a fixed
function of the tokens so far (no model): greedy requests with processors, grammars,
log-probabilities and n > 1 give exactly the plain engine's tokens and log-probabilities,
and sampled requests follow the target distribution exactly (a chi-square test of the
first tokens against the distribution computed by enumeration, with a wrong rule as the
negative control)."""

from __future__ import annotations

import hashlib
import math
import re
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from contract.speculative import Speculative
from runtime.core import requests as requests_mod
from runtime.core.plan import StepPlan
from runtime.core.scheduler import SchedulerConfig
from runtime.core.spec import keeps_draft, residual, verify_sampled
from runtime.core.types import SamplingParams, TokenEvent, TokenLogprob
from runtime.executors.loop import LLMEngine
from tests.unit.test_scheduler import MirrorRunner

EOS = 0
LogitsFn = Callable[[list[int]], torch.Tensor]


def hashed_logits(vocab: int, scale: float, favour: float = 0.0, context: int = 2) -> LogitsFn:
    """Logits [V] that depend on the last `context` tokens only (so outputs cycle and prompt
    lookup drafts get accepted), plus `favour` on the token after the last one in the
    cycle 1, 2, ..., V-1 (so copies of a counting prompt are likely, not certain)."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def fn(tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens[-context:])
        if key not in cache:
            seed = int.from_bytes(hashlib.blake2b(array("q", key).tobytes(),
                                                  digest_size=8).digest(), "little")
            row = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
            if favour:
                row[key[-1] % (vocab - 1) + 1] += favour
            cache[key] = row
        return cache[key]

    return fn


class LogitsRunner:
    """A ModelRunner stand-in: MirrorRunner's bookkeeping and checks of every plan (the
    runner-side state, the KV slots' prefixes), and a logits row for every row the plan
    asks for, in the runner's order: sampled rows, prompt-logits rows, draft rows."""

    def __init__(self, block_size: int, fn: LogitsFn) -> None:
        # The mirror's "model" returns the prefix itself: the rows are fn of those.
        self.mirror = MirrorRunner(block_size, lambda t: t)  # type: ignore[arg-type,return-value]
        self.fn = fn

    def execute(self, plan: StepPlan) -> tuple[list[int], torch.Tensor | None]:
        prefixes: dict[int, list[list[int]]] = self.mirror.verify(plan)  # type: ignore[assignment]
        if not plan.scheduled:
            return [], None
        sampled = [s.seq_id for s in plan.scheduled if s.sample]
        rows = [prefixes[sid][-1] for sid in sampled]  # after the last draft (the bonus)
        for s in plan.scheduled:
            known = self.mirror.tokens[s.seq_id]
            rows += [known[:p + 1] for p in range(s.num_computed_tokens,
                                                 s.num_computed_tokens + s.prompt_logits)]
        for s in plan.scheduled:
            if s.draft_token_ids:
                rows += prefixes[s.seq_id][:-1]
        if not rows:  # a prompt chunk that ends before the prompt does: no row at all
            return sampled, torch.empty(0, self.fn([0]).shape[0])
        return sampled, torch.stack([self.fn(list(r)) for r in rows])


def engine(fn: LogitsFn, k: int | None, **kw: object) -> LLMEngine:
    base: dict[str, object] = dict(max_batch_size=8, max_num_tokens=64, block_size=4,
                                   num_blocks=1 + 400, max_seq_len=96, eos_token_ids=(EOS,),
                                   speculative=Speculative("ngram", k) if k else None,
                                   # the acceptance rule under test, not the adaptive policy
                                   # (tests/unit/test_spec.py): every match drafts, at any batch
                                   spec_adaptive=False)
    base.update(kw)
    cfg = SchedulerConfig(**base)  # type: ignore[arg-type]
    return LLMEngine(LogitsRunner(cfg.block_size, fn), cfg)  # type: ignore[arg-type]


Outcome = tuple[list[int], str, list[TokenLogprob] | None, float | None, list[int]]


def run(eng: LLMEngine, reqs: list[tuple[list[int], SamplingParams]]
        ) -> dict[tuple[str, int], Outcome]:
    """Every request at once, stepped to the end: per (request, choice) its tokens, finish
    reason, log-probabilities, cumulative log-probability and event sizes."""
    out: dict[tuple[str, int], Outcome] = {}

    def cb(ev: TokenEvent) -> None:
        tokens, finish, lps, _, sizes = out.setdefault(
            (ev.request_id, ev.index), ([], "", None, None, []))
        tokens.extend(ev.token_ids)
        if ev.token_ids:
            sizes.append(len(ev.token_ids))
        if ev.logprobs is not None:
            lps = (lps or []) + list(ev.logprobs)
            assert len(ev.logprobs) == len(ev.token_ids)
        out[(ev.request_id, ev.index)] = (tokens, ev.finish_reason or finish, lps,
                                          ev.cumulative_logprob, sizes)

    for i, (prompt, params) in enumerate(reqs):
        eng.add_request(str(i), prompt, params, cb)
    steps = 0
    while eng.num_unfinished():
        eng.step()
        eng.scheduler.block_manager.check_integrity()
        steps += 1
        assert steps < 50_000
    assert eng.scheduler.block_manager.num_used == 0
    return out


# ---- the acceptance rule itself ---------------------------------------------------------


def test_rejection_rule_and_residual() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert keeps_draft(p, 0, 0.49) and not keeps_draft(p, 0, 0.5)
    assert not keeps_draft(p, 3, 0.0)  # no mass: always rejected
    assert torch.equal(residual(p, 1), torch.tensor([0.5, 0.0, 0.2, 0.0]))
    # a draft model's q: keep with min(1, p/q), residual max(0, p - q)
    q = torch.tensor([0.25, 0.6, 0.1, 0.05])
    assert keeps_draft(p, 0, 0.999, q)  # p/q = 2
    assert keeps_draft(p, 1, 0.49, q) and not keeps_draft(p, 1, 0.51, q)  # p/q = 0.5
    assert torch.allclose(residual(p, 1, q), torch.tensor([0.25, 0.0, 0.1, 0.0]))
    # verify_sampled: a point-mass drafter takes the plain draw (one number); with q, the
    # rule, then the residual's draw (two numbers on a rejection)
    draws: list[tuple[list[float], float]] = []

    def draw(w: torch.Tensor, u: float) -> int:
        draws.append((w.tolist(), u))
        return int((w.cumsum(0) > u * w.sum()).nonzero()[0])

    us = iter([0.6, 0.7, 0.1])
    assert verify_sampled(p, 0, lambda: next(us), draw) == 1  # the plain draw at 0.6
    assert draws == [(p.tolist(), 0.6)]
    assert verify_sampled(p, 1, lambda: next(us), draw, q) == 0  # 0.7 > p/q: rejected
    assert draws[1] == (residual(p, 1, q).tolist(), 0.1)


# ---- greedy: identical with and without speculation -------------------------------------

COUNT = list(range(1, 12))  # a counting prompt: favour makes the model continue it


def greedy(max_tokens: int = 40, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def greedy_requests() -> list[tuple[list[int], SamplingParams]]:
    p1 = COUNT * 2
    p2 = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    return [
        (p1, greedy(ignore_eos=True)),
        (p1, greedy(logprobs=3, ignore_eos=True)),
        (p2, greedy(logprobs=0)),
        (p1, greedy(max_tokens=18, ignore_eos=True)),  # ends in a verify step
        (p1, greedy(stop_token_ids=(2,), ignore_eos=True)),  # first 2 is a kept draft
        (p1, greedy(n=2, ignore_eos=True, logprobs=1)),
        (p1, greedy(n=1, best_of=2, ignore_eos=True)),
        (p1, greedy(repetition_penalty=1.3, ignore_eos=True)),
        (p2, greedy(presence_penalty=0.6, frequency_penalty=0.4, ignore_eos=True)),
        (p1, greedy(logit_bias=((5, -3.0), (7, 2.5)), ignore_eos=True)),
        (p2, greedy(min_tokens=20, stop_token_ids=(5,), max_tokens=30)),
        (p1, SamplingParams(max_tokens=30, temperature=1.3, top_k=1, logprobs=2,
                            ignore_eos=True)),  # greedy by top_k=1, tempered log-probs
    ]


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_with_processors_and_logprobs_equals_plain_decoding(k: int) -> None:
    fn = hashed_logits(16, 2.0, favour=3.5)
    reqs = greedy_requests()
    plain = run(engine(fn, None), reqs)
    spec_engine = engine(fn, k)
    spec = run(spec_engine, reqs)
    assert spec.keys() == plain.keys()
    for key in plain:
        i = int(key[0])
        assert spec[key][:4] == plain[key][:4], f"request {i}: {reqs[i][1]}"
    # every kind verified drafts and kept some (events of several tokens), so the equality
    # above covers the speculative path
    for key in plain:
        if key != ("4", 0):  # its stop token is a verify step's first kept draft (below)
            assert max(spec[key][4]) > 1, f"request {key}: nothing accepted"
    stats = spec_engine.stats().extra
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] < stats[
        "spec_decode_num_draft_tokens_total"]
    # max_tokens landed inside a verify step, the stop token on a kept draft
    assert len(spec[("3", 0)][0]) == 18 and spec[("4", 0)][1] == "stop"
    # request 0 is request 4 without the stop token: where 2 first came, a verify step
    # kept drafts (its event has more than one token) and 2 was the first of them
    tokens = spec[("4", 0)][0]
    starts = {sum(spec[("0", 0)][4][:j]): n for j, n in enumerate(spec[("0", 0)][4])}
    assert tokens[-1] == 2 and starts.get(len(tokens) - 1, 1) > 1


@pytest.fixture(scope="module")
def grammar_compiler() -> Iterator[object]:
    from runtime.core.grammar import GrammarCompiler
    from tests.unit.test_detok import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    yield tok, GrammarCompiler(tok, len(tok), [tok.eos_token_id])


def test_grammar_drafts_are_masked_and_greedy_output_equals_plain(
        grammar_compiler: tuple[object, object]) -> None:
    from runtime.core.types import GuidedSpec

    tok, compiler = grammar_compiler
    eos = tok.eos_token_id  # type: ignore[attr-defined]
    vocab = len(tok)  # type: ignore[arg-type]
    spec = GuidedSpec("regex", "(ab|cd|ef){4,12}")
    grammar = compiler.compile(spec)  # type: ignore[attr-defined]
    prompt = tok("ab cd ab ef ab cd ab ef")["input_ids"]  # type: ignore[operator]
    fn = hashed_logits(vocab, 3.0)
    reqs = [(prompt, SamplingParams(max_tokens=40, temperature=0.0, guided=spec,
                                    grammar=grammar, logprobs=2, seed=s))
            for s in range(4)]
    reqs += [(prompt, SamplingParams(max_tokens=40, temperature=0.8, guided=spec,
                                     grammar=grammar, seed=s)) for s in range(4)]
    kw = dict(eos_token_ids=(eos,))
    plain = run(engine(fn, None, **kw), reqs)
    spec_engine = engine(fn, 4, **kw)
    got = run(spec_engine, reqs)
    for key in plain:
        text = tok.decode(got[key][0], skip_special_tokens=True)  # type: ignore[attr-defined]
        assert re.fullmatch("(ab|cd|ef){4,12}", text), text
        if int(key[0]) < 4:  # greedy: exactly the plain engine's
            assert got[key][:4] == plain[key][:4]
    stats = spec_engine.stats().extra
    # the drafter copies the prompt's spaces, which the grammar forbids: rejected (p = 0)
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] < stats[
        "spec_decode_num_draft_tokens_total"]


def test_seeded_sampled_requests_repeat_and_draw_logprobs_of_their_tokens() -> None:
    fn = hashed_logits(16, 1.5, favour=3.0)
    params = [SamplingParams(max_tokens=30, temperature=0.7, seed=s, logprobs=2,
                             ignore_eos=True, top_p=0.95, presence_penalty=0.3)
              for s in range(6)]
    reqs = [(COUNT * 2, p) for p in params]
    a, b = run(engine(fn, 4), reqs), run(engine(fn, 4), reqs)
    assert a == b
    assert any(max(v[4]) > 1 for v in a.values()), "drafts accepted"
    # ... and give what they give without speculation: with a deterministic drafter the
    # kept/replaced decision is the plain draw (spec.verify_sampled), one number a token
    plain = run(engine(fn, None), reqs)
    assert {key: v[:4] for key, v in a.items()} == {key: v[:4] for key, v in plain.items()}
    # and whatever the step's room gives each request in drafts (here K = 2 and a budget
    # of 12 tokens: other drafts than above)
    tight = run(engine(fn, 2, max_num_tokens=12), reqs)
    assert {key: v[:4] for key, v in tight.items()} == {key: v[:4] for key, v in plain.items()}
    # the reported log-probabilities are those of the processed rows at those tokens
    # (checked against a plain replay of the same tokens)
    from runtime.core.logits import SeqSampling
    from runtime.core.sampler import Sampler

    for (rid, _), (tokens, _, lps, _, _) in a.items():
        p = params[int(rid)]
        st = SeqSampling(p, None, (), COUNT * 2)
        assert lps is not None
        for j, (t, lp) in enumerate(zip(tokens, lps)):
            tempered = Sampler.process(fn(COUNT * 2 + tokens[:j]).unsqueeze(0), [st])[0]
            assert lp == Sampler.token_logprob(tempered, t, 2)
            st.accept(t, lp.logprob)


# ---- sampled: the distribution is exactly the target's ----------------------------------

STAT_VOCAB = 6
STAT_PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4]
STAT_PARAMS = dict(temperature=0.9, top_k=4, top_p=0.9, repetition_penalty=1.2,
                   presence_penalty=0.5, ignore_eos=True)


def target_probs(fn: LogitsFn, prefix: list[int], output: list[int]) -> list[float]:
    """The target distribution of the next token, written out independently of the
    sampler: repetition penalty on prompt and output tokens, presence penalty on output
    tokens, temperature, top-k, then top-p (smallest prefix whose mass reaches it)."""
    p = STAT_PARAMS
    logits = fn(prefix + output).tolist()
    seen = set(prefix) | set(output)
    for t in range(len(logits)):
        if t in seen:
            x = logits[t]
            logits[t] = x / p["repetition_penalty"] if x > 0 else x * p["repetition_penalty"]
        if t in output:
            logits[t] -= p["presence_penalty"]
    logits = [x / p["temperature"] for x in logits]
    order = sorted(range(len(logits)), key=lambda t: -logits[t])[:int(p["top_k"])]
    m = max(logits[t] for t in order)
    w = {t: math.exp(logits[t] - m) for t in order}
    z = sum(w.values())
    kept, mass = [], 0.0
    for t in order:
        if mass >= p["top_p"]:
            break
        kept.append(t)
        mass += w[t] / z
    z = sum(w[t] for t in kept)
    return [w[t] / z if t in kept else 0.0 for t in range(len(logits))]


def joint(fn: LogitsFn, n: int) -> dict[tuple[int, ...], float]:
    """P(first n output tokens), by enumeration."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        nxt: dict[tuple[int, ...], float] = {}
        for seq, pr in out.items():
            for t, q in enumerate(target_probs(fn, STAT_PROMPT, list(seq))):
                if q > 0:
                    nxt[seq + (t,)] = pr * q
        out = nxt
    return out


def chi_square_pvalue(counts: Counter[tuple[int, ...]], probs: dict[tuple[int, ...], float],
                      n: int) -> float:
    """Pearson's goodness of fit; cells expecting fewer than 5 are pooled into one."""
    from scipy.stats import chi2

    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    assert set(counts) <= set(probs), f"impossible outputs: {set(counts) - set(probs)}"
    for cell, pr in probs.items():
        e = n * pr
        if e < 5:
            pooled_obs += counts[cell]
            pooled_exp += e
            continue
        stat += (counts[cell] - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return float(chi2.sf(stat, cells - 1))


def sample_first_tokens(fn: LogitsFn, n: int, k: int | None) -> tuple[Counter[tuple[int, ...]],
                                                                     dict[str, float]]:
    eng = engine(fn, k, max_batch_size=64, max_num_tokens=512, num_blocks=1 + 1200)
    reqs = [(STAT_PROMPT, SamplingParams(max_tokens=4, seed=1000 + i, **STAT_PARAMS))  # type: ignore[arg-type]
            for i in range(n)]
    out = run(eng, reqs)
    return Counter(tuple(v[0][:3]) for v in out.values()), eng.stats().extra


N_SAMPLES = 2000  # ~4 s a run; the wrong rules below give p-values under 1e-100


@pytest.fixture(scope="module")
def stat_fn() -> LogitsFn:
    # Peaky enough that the favoured continuation (the drafts) is often but not always
    # the draw: drafts are both kept and rejected.
    return hashed_logits(STAT_VOCAB, 1.0, favour=2.0, context=1)


def test_sampled_speculation_follows_the_target_distribution(stat_fn: LogitsFn) -> None:
    probs = joint(stat_fn, 3)
    # the enumerated target is the plain engine's (a check of the reference itself)
    counts, _ = sample_first_tokens(stat_fn, N_SAMPLES, None)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) > 1e-3
    counts, stats = sample_first_tokens(stat_fn, N_SAMPLES, 3)
    drafted = stats["spec_decode_num_draft_tokens_total"]
    accepted = stats["spec_decode_num_accepted_tokens_total"]
    assert 0.1 * drafted < accepted < 0.9 * drafted, (accepted, drafted)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) > 1e-3


def test_a_wrong_rule_fails_the_same_statistic(stat_fn: LogitsFn,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative controls: keeping every draft, or drawing the replacement from p itself
    (the draft not removed), is detected by the test above."""
    probs = joint(stat_fn, 3)
    monkeypatch.setattr(requests_mod, "verify_sampled", lambda p, d, uniform, draw, q=None: d)
    counts, _ = sample_first_tokens(stat_fn, N_SAMPLES, 3)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) < 1e-6

    def redraw_from_p(p: torch.Tensor, d: int, uniform: Any, draw: Any, q: Any = None) -> int:
        # keeps d with probability p(d), but replaces it by a fresh draw from p itself
        return d if draw(p, uniform()) == d else draw(p, uniform())

    monkeypatch.setattr(requests_mod, "verify_sampled", redraw_from_p)
    counts, _ = sample_first_tokens(stat_fn, N_SAMPLES, 3)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) < 1e-3
