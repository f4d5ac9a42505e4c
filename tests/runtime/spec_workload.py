"""Speculative decoding against plain decoding on one engine: a workload whose outputs
repeat (so prompt-lookup drafts are accepted), and a driver that records each request's
tokens, finish reason and events. Shared by the TP=1 test and the TP=2 mpirun worker."""

from __future__ import annotations

import random

from runtime.core.types import SamplingParams, TokenEvent
from runtime.executors.loop import LLMEngine

Result = dict[str, tuple[list[int], str, list[int]]]  # id -> (tokens, finish, event sizes)


def spec_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (a phrase copied, a cycle), and one that does not."""
    rng = random.Random(seed)
    phrase = [rng.randrange(1, 256) for _ in range(9)]
    return [
        phrase * 4,
        [5, 6, 7, 8, 9, 10] * 5 + [5, 6],
        [rng.randrange(1, 256) for _ in range(20)] + phrase + [3, 3, 3] + phrase[:4],
        [rng.randrange(1, 256) for _ in range(13)],
    ]


def run_requests(engine: LLMEngine, reqs: list[tuple[list[int], SamplingParams]],
                 stagger: int = 1, logprobs: dict[str, list[float]] | None = None) -> Result:
    """Submit request i at step stagger * i, step to the end; check blocks after each step.
    `logprobs`: filled with each request's token log-probabilities (those that ask for them)."""
    out: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    sizes: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    done: dict[str, str] = {}

    def cb(ev: TokenEvent) -> None:
        out[ev.request_id].extend(ev.token_ids)
        if logprobs is not None and ev.logprobs:
            logprobs.setdefault(ev.request_id, []).extend(lp.logprob for lp in ev.logprobs)
        if ev.token_ids:
            sizes[ev.request_id].append(len(ev.token_ids))
        if ev.finish_reason:
            done[ev.request_id] = ev.finish_reason

    step = 0
    while len(done) < len(reqs):
        for i, (prompt, params) in enumerate(reqs):
            if stagger * i == step:
                engine.add_request(str(i), prompt, params, cb)
        engine.step()
        engine.scheduler.block_manager.check_integrity()
        step += 1
        assert step < 5000
    bm = engine.scheduler.block_manager
    assert bm.num_used == 0, "every block is back once the requests are done"
    return {k: (out[k], done[k], sizes[k]) for k in out}


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def mid_draft_cases(prompts: list[list[int]], free: Result) -> list[tuple[list[int], SamplingParams]]:
    """From a speculative run without limits, requests that end inside a verify step's
    accepted tokens: max_tokens landing there, and a stop token first produced there."""
    cases: list[tuple[list[int], SamplingParams]] = []
    for i, prompt in enumerate(prompts):
        tokens, _, sizes = free[str(i)]
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        # tokens at .. at+n-2 of an event of n tokens are accepted drafts
        long = [(at, n) for at, n in zip(starts, sizes) if n >= 3]
        if long:
            at, _ = long[0]
            cases.append((prompt, greedy(at + 2)))  # ends on the second accepted draft
        stop = next((t for at, n in zip(starts, sizes) if n >= 2
                     for t in tokens[at:at + n - 1] if t not in tokens[:at]), None)
        if stop is not None:
            cases.append((prompt, greedy(64, stop_token_ids=(stop,))))
    return cases


def build_workload(engine: LLMEngine) -> list[tuple[list[int], SamplingParams]]:
    """Greedy requests with and without limits, a sampled one (it speculates too) and
    requests that end mid-draft, found by running `engine` (speculative) beforehand.

    A stop token ends a request mid-draft only where its first output occurrence is an
    accepted draft, and drafts come from earlier context: so some prompts carry the first
    tokens of their own greedy continuation, which the output then repeats."""
    prompts = spec_prompts()
    first = run_requests(engine, [(p, greedy(40)) for p in prompts])
    prompts += [p + first[str(i)][0][:m] for i, p in enumerate(prompts) for m in (3, 6)]
    free = run_requests(engine, [(p, greedy(40)) for p in prompts])
    reqs = [(p, greedy(40)) for p in prompts]
    reqs.append((prompts[0], SamplingParams(max_tokens=12, temperature=0.8, seed=7)))
    reqs.append((prompts[1], greedy(1)))
    return reqs + mid_draft_cases(prompts, free)
