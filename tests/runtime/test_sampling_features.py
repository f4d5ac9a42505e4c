"""Penalties, logit_bias, min_tokens, log-probabilities, seeds, n > 1 and prompt
log-probabilities through the real torch engine (TP=1, eager) against transformers on the
same weights: its logits, its own logits processors (RepetitionPenalty, SequenceBias,
MinNewTokensLength) where it has them, and the OpenAI formula where it does not
(presence/frequency penalties). Seeded draws are replayed from transformers' logits with
the documented inverse-CDF rule and the same torch.Generator stream."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from runtime.core.scheduler import SchedulerConfig
from runtime.core.types import SamplingParams, TokenEvent
from runtime.executors.loop import LLMEngine
from runtime.executors.torch import runner_from_checkpoint
from runtime.models.parallel import TPContext
from tests.runtime.hf_reference import hf_model
from tests.runtime.test_engine import BLOCK, make_engine

PROMPT = [3, 17, 45, 3, 17, 99, 120, 7, 7, 64, 3]  # 11 tokens: 2 full blocks of 4 + 3
STOP = 5


class Collect:
    def __init__(self) -> None:
        self.events: list[TokenEvent] = []

    def __call__(self, ev: TokenEvent) -> None:
        self.events.append(ev)

    def tokens(self, index: int = 0) -> list[int]:
        return [t for e in self.events if e.index == index for t in e.token_ids]

    def logprobs(self, index: int = 0) -> list:
        return [lp for e in self.events if e.index == index for lp in (e.logprobs or [])]

    def final(self, index: int = 0) -> TokenEvent:
        return next(e for e in self.events if e.index == index and e.finish_reason)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str = "r") -> Collect:
    sink = Collect()
    engine.add_request(rid, prompt, params, sink)
    while engine.num_unfinished():
        engine.step()
    return sink


@pytest.fixture(scope="module")
def path(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def engine(path: Path) -> LLMEngine:
    return make_engine(path)


def _presence_frequency(presence: float, frequency: float, prompt_len: int):
    """OpenAI's definition: logit -= frequency * count + presence * (count > 0), output only."""
    def proc(input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[0, prompt_len:]
        if len(out):
            counts = torch.bincount(out, minlength=scores.shape[1]).float()
            scores = scores - frequency * counts - presence * (counts > 0).float()
        return scores
    return proc


def hf_processors(p: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """transformers' processors, in the order the engine documents (runtime/core/logits.py)."""
    procs: list = []
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias}))
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(_presence_frequency(p.presence_penalty, p.frequency_penalty, prompt_len))
    if p.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, list(
            p.stop_token_ids)))
    return LogitsProcessorList(procs)


@torch.inference_mode()
def hf_steps(path: Path, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """transformers' processed, temperature-scaled logits before each output token [n, V]."""
    procs = hf_processors(p, len(prompt))
    rows = []
    full = torch.tensor([prompt + out])
    logits = hf_model(str(path))(full).logits[0]
    for i in range(len(out)):
        ids = full[:, :len(prompt) + i]
        scores = procs(ids, logits[len(prompt) + i - 1].unsqueeze(0).clone())[0]
        rows.append(scores / p.temperature if p.temperature > 0 else scores)
    return torch.stack(rows)


PENALTIES = [
    SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.8),
    SamplingParams(max_tokens=12, temperature=0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(max_tokens=12, temperature=0, logit_bias=((17, 8.0), (3, -100.0))),
    SamplingParams(max_tokens=12, temperature=0, min_tokens=6, stop_token_ids=(STOP,),
                   logit_bias=((STOP, 30.0),)),
    SamplingParams(max_tokens=12, temperature=0, repetition_penalty=0.7,
                   frequency_penalty=-0.5, logit_bias=((120, 3.0),)),
]


@pytest.mark.parametrize("params", PENALTIES, ids=lambda p: "greedy")
def test_greedy_with_processors_matches_transformers_generate(engine: LLMEngine, path: Path,
                                                              params: SamplingParams) -> None:
    got = run(engine, PROMPT, params).tokens()
    with torch.inference_mode():
        ref = hf_model(str(path)).generate(
            torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=params.max_tokens, do_sample=False,
            logits_processor=hf_processors(params, len(PROMPT)),
            eos_token_id=list(params.stop_token_ids) or None, pad_token_id=0)
    want = ref[0, len(PROMPT):].tolist()
    assert got == want
    if params.min_tokens:  # the stop token is boosted, so it comes as soon as allowed
        assert len(got) == params.min_tokens + 1 and got[-1] == STOP


def test_logprobs_are_the_processed_distribution(engine: LLMEngine, path: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, logprobs=5)
    sink = run(engine, PROMPT, params)
    out, lps = sink.tokens(), sink.logprobs()
    ref = hf_steps(path, PROMPT, out, params).log_softmax(-1)
    assert [lp.token for lp in lps] == out
    for i, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(ref[i, out[i]].item(), abs=1e-4)
        vals, ids = ref[i].topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-4)
    assert sink.final().cumulative_logprob == pytest.approx(sum(lp.logprob for lp in lps))


def _replay(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF, written independently: the first token whose cumulative mass > u."""
    total, acc = float(probs.sum()), 0.0
    for token, q in enumerate(probs.tolist()):
        acc += q
        if q > 0 and acc > u * total:
            return token
    return int(torch.nonzero(probs).max())


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0.8, seed=1234, presence_penalty=0.6,
                   logprobs=2),
    SamplingParams(max_tokens=10, temperature=1.3, seed=77, repetition_penalty=1.5,
                   frequency_penalty=0.4, logprobs=0),
])
def test_seeded_draws_replay_from_transformers_logits(engine: LLMEngine, path: Path,
                                                      params: SamplingParams) -> None:
    sink = run(engine, PROMPT, params)
    out, lps = sink.tokens(), sink.logprobs()
    scaled = hf_steps(path, PROMPT, out, params)
    gen = torch.Generator().manual_seed(params.seed)
    for i, token in enumerate(out):
        u = torch.rand((), generator=gen).item()
        assert token == _replay(scaled[i].softmax(-1), u), f"step {i}"
        assert lps[i].logprob == pytest.approx(scaled[i].log_softmax(-1)[token].item(),
                                               abs=1e-4)


def test_seed_is_reproducible_and_independent_of_batch_neighbours(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, frequency_penalty=0.3)
    alone = run(engine, PROMPT, params).tokens()
    assert run(engine, PROMPT, params).tokens() == alone
    sink = Collect()
    engine.add_request("x", PROMPT, params, sink)
    for i in range(3):  # neighbours with their own prompts, seeds and penalties
        engine.add_request(f"n{i}", [9, 8, 7][i:] + PROMPT, SamplingParams(
            max_tokens=6 + i, temperature=0.9, seed=i, presence_penalty=0.5), Collect())
    while engine.num_unfinished():
        engine.step()
    assert sink.tokens() == alone


def test_n_shares_one_prefill_and_each_sequence_is_its_own_seed(path: Path) -> None:
    engine = make_engine(path)
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=40, n=3, logprobs=0)
    before = engine.scheduler.stats()
    sink = run(engine, PROMPT, params)
    after = engine.scheduler.stats()
    singles = [run(engine, PROMPT, SamplingParams(max_tokens=9, temperature=1.0, seed=40 + k),
                   f"s{k}").tokens() for k in range(3)]
    assert [sink.tokens(k) for k in range(3)] == singles
    assert after.prompt_tokens_computed_total - before.prompt_tokens_computed_total \
        == len(PROMPT)
    assert after.forked_sequences_total - before.forked_sequences_total == 2
    assert after.kv_blocks_copied_total - before.kv_blocks_copied_total == 2  # 11 % 4 != 0
    assert [sink.final(k).finish_reason for k in range(3)] == ["length"] * 3
    assert engine.scheduler.block_manager.num_used == 0
    engine.scheduler.block_manager.check_integrity()


def test_n_under_kv_pressure_still_matches(path: Path) -> None:
    # 12 usable blocks of 4: the prompt's 3 blocks plus 4 sequences of 20 tokens do not fit
    # at once, so siblings wait or are preempted and recomputed.
    engine = make_engine(path, num_blocks=13)
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=3, n=4)
    sink = run(engine, PROMPT, params)
    for k in range(4):
        alone = run(engine, PROMPT, SamplingParams(max_tokens=20, temperature=0.7, seed=3 + k),
                    f"s{k}").tokens()
        assert sink.tokens(k) == alone, k
    engine.scheduler.block_manager.check_integrity()
    assert engine.scheduler.block_manager.num_used == 0


def test_prompt_logprobs_match_transformers(path: Path) -> None:
    # A small bound on logits rows (a compiled engine's) forces the prompt into chunks.
    runner, _ = runner_from_checkpoint(path, TPContext(), "float32", 128, BLOCK)
    engine = LLMEngine(runner, SchedulerConfig(4, 64, BLOCK, 128, 256, (), max_logit_rows=5))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3, logprobs=1)
    prompt = PROMPT * 3  # 33 tokens
    sink = run(engine, prompt, params)
    first = next(e for e in sink.events if e.prompt_logprobs is not None)
    got = first.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    with torch.inference_mode():
        ref = hf_model(str(path))(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for pos in range(1, len(prompt)):
        lp = got[pos]
        assert lp is not None and lp.token == prompt[pos]
        assert lp.logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[pos - 1].topk(3).indices.tolist()


def test_best_of_reports_each_sequences_cumulative_logprob(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=9, n=1, best_of=3)
    sink = run(engine, PROMPT, params)
    finals = [sink.final(k) for k in range(3)]
    assert all(f.cumulative_logprob is not None and f.cumulative_logprob < 0 for f in finals)
    assert len({tuple(sink.tokens(k)) for k in range(3)}) > 1
