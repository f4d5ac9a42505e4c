"""The torch runtime at TP=1: logit parity, in-flight batching, preemption, cancel."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from runtime.core.plan import NewSeq, ScheduledSeq, StepPlan
from runtime.core.scheduler import SchedulerConfig
from runtime.core.types import SamplingParams, TokenEvent
from runtime.executors.loop import LLMEngine
from runtime.executors.torch import runner_from_checkpoint
from runtime.models.parallel import TPContext
from tests.runtime.hf_reference import greedy, last_logits, rel_err

BLOCK = 4


def make_engine(path: Path, num_blocks: int = 128, max_batch: int = 16, max_tokens: int = 64) -> LLMEngine:
    runner, cfg = runner_from_checkpoint(path, TPContext(), "float32", num_blocks, BLOCK)
    sc = SchedulerConfig(max_batch, max_tokens, BLOCK, num_blocks, 256, cfg.eos_token_ids)
    return LLMEngine(runner, sc)


@pytest.mark.parametrize("bucket", [1, 16])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_logit_parity_prefill_and_mixed_decode(tiny_models: dict[str, Path], kind: str,
                                               bucket: int) -> None:
    path = tiny_models[kind]
    runner, _ = runner_from_checkpoint(path, TPContext(), "float32", 64, BLOCK)
    runner.token_bucket = bucket  # 16: steps padded with dummy tokens, same logits
    a, b, c = [1, 5, 9, 33, 7, 100, 3], [4, 8, 15, 16, 23, 42, 99, 12, 13, 14, 1], [7, 7, 7, 1, 2]
    ids, logits = runner.execute(StepPlan(0, new_seqs=[NewSeq(0, a), NewSeq(1, b)], scheduled=[
        ScheduledSeq(0, 0, 7, [1, 2], True), ScheduledSeq(1, 0, 11, [3, 4, 5], True)]))
    assert ids == [0, 1]
    for row, toks in zip(logits, (a, b)):
        assert rel_err(row, last_logits(path, toks)) < 1e-4
    # Two decodes and a new prefill in one step, decodes on both sides of the prefill.
    ids, logits = runner.execute(StepPlan(1, new_seqs=[NewSeq(2, c)], appended_tokens={0: 50, 1: 60},
                                          scheduled=[ScheduledSeq(0, 7, 1, [], True),
                                                     ScheduledSeq(2, 0, 5, [6, 7], True),
                                                     ScheduledSeq(1, 11, 1, [], True)]))
    assert ids == [0, 2, 1]
    for row, toks in zip(logits, (a + [50], c, b + [60])):
        assert rel_err(row, last_logits(path, toks)) < 1e-4


def staggered_workload(seed: int = 0, n: int = 10) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_tokens) with varied prompt lengths and budgets."""
    rng = random.Random(seed)
    return [(2 * i, [rng.randrange(256) for _ in range(rng.randint(1, 70))], rng.randint(1, 24))
            for i in range(n)]


def run_staggered(engine: LLMEngine, work: list[tuple[int, list[int], int]], check=None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {str(i): [] for i in range(len(work))}
    done: dict[str, str | None] = {}

    def cb(ev: TokenEvent) -> None:
        out[ev.request_id].extend(ev.token_ids)
        if ev.finish_reason:
            done[ev.request_id] = ev.finish_reason

    step = 0
    while len(done) < len(work):
        for i, (arrive, prompt, mt) in enumerate(work):
            if arrive == step:
                engine.add_request(str(i), prompt, SamplingParams(max_tokens=mt, temperature=0), cb)
        engine.step()
        if check:
            check(engine)
        step += 1
        assert step < 2000
    assert all(r == "length" for r in done.values())
    return out


def test_inflight_batching_matches_generate_alone(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["llama"]
    work = staggered_workload()
    # A small token budget forces chunked prefill next to running decodes.
    out = run_staggered(make_engine(path, max_tokens=32), work)
    for i, (_, prompt, mt) in enumerate(work):
        assert out[str(i)] == greedy(path, prompt, mt), f"request {i}"


def test_preemption_keeps_outputs_exact(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["qwen2"]
    work = staggered_workload(seed=1, n=8)
    work = [(0, p, mt) for _, p, mt in work]  # all at once, so the pool overflows
    # 26 usable blocks of 4 tokens: the biggest request fits alone, not all of them together.
    engine = make_engine(path, num_blocks=27)

    def check(e: LLMEngine) -> None:
        e.scheduler.block_manager.check_integrity()

    out = run_staggered(engine, work, check)
    assert engine.stats().preemptions_total > 0
    bm = engine.scheduler.block_manager
    assert bm.num_used == 0 and bm.num_free == bm.num_usable
    for i, (_, prompt, mt) in enumerate(work):
        assert out[str(i)] == greedy(path, prompt, mt), f"request {i}"


def test_cancel_frees_blocks_at_once_and_spares_others(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["mistral"]
    engine = make_engine(path)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 6, 1, 8, 0, 3, 3, 9, 8]]
    got: dict[str, list[int]] = {"0": [], "1": [], "2": []}
    reasons: dict[str, str] = {}

    def cb(ev: TokenEvent) -> None:
        got[ev.request_id].extend(ev.token_ids)
        if ev.finish_reason:
            reasons[ev.request_id] = ev.finish_reason

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0), cb)
    for _ in range(5):
        engine.step()
    used_before = engine.scheduler.block_manager.num_used
    held = len(engine.scheduler.get(engine.requests.groups["1"].seq_ids[0]).block_ids)
    engine.cancel("1")
    engine.step()  # the cancel is applied at the start of the next iteration
    assert reasons["1"] == "cancelled"
    # Blocks of the cancelled request are free; the others may have taken at most one each.
    assert engine.scheduler.block_manager.num_used <= used_before - held + 2
    while len(reasons) < 3:
        engine.step()
    assert engine.scheduler.block_manager.num_used == 0
    for i in (0, 2):
        assert got[str(i)] == greedy(path, prompts[i], 20)
    assert len(got["1"]) < 20


def test_seeded_sampling_is_reproducible(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"])
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    a, b = engine.generate([[1, 2, 3], [1, 2, 3]], [p, p])
    assert a == b
    (c,) = engine.generate([[1, 2, 3]], [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=99)])
    assert c != a


def test_a_request_refused_at_admission_is_rejected_and_others_run(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"])
    events: list[TokenEvent] = []
    engine.add_request("big", [1] * 250, SamplingParams(max_tokens=100), events.append)
    (ok,) = engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=3, temperature=0)])
    assert events[0].finish_reason == "rejected" and "maximum context length of" in (events[0].error or "")
    assert len(ok) == 3
    assert torch.is_grad_enabled()


def test_step_time_totals_count_decode_and_prefill_steps_apart(tiny_models: dict[str, Path]) -> None:
    """What /metrics mirrors as llmserve_{decode,prefill}_step[s|_seconds]_total."""
    engine = make_engine(tiny_models["llama"], max_tokens=16)
    events: list[TokenEvent] = []
    # 40 prompt tokens at 16 a step: three steps with prompt tokens (the third samples the
    # first token), then 5 decode-only steps for the other 5 tokens.
    engine.add_request("r", list(range(1, 41)), SamplingParams(max_tokens=6, ignore_eos=True),
                       events.append)
    steps = []
    while engine.num_unfinished():
        plan = engine.step()
        if plan is not None:
            steps.append("decode" if plan.num_tokens == len(plan.scheduled) else "prefill")
    extra = engine.stats().extra
    assert sum(len(e.token_ids) for e in events) == 6
    assert steps == ["prefill"] * 3 + ["decode"] * 5
    assert (extra["prefill_steps_total"], extra["decode_steps_total"]) == (3.0, 5.0)
    assert extra["prefill_step_seconds_total"] > 0 and extra["decode_step_seconds_total"] > 0
