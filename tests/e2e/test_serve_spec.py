"""Speculative decoding through the HTTP server: `serve launch --speculative ngram:4` on the
session's TP=2 engine answers greedy requests exactly as transformers does (the prompt
repeats itself, so drafts are verified and accepted), counts drafts on /metrics and shows
the drafter on /v1/engine. Requests with log-probabilities, structured output and stop
strings answer as the plain server does, with drafts accepted; seeded sampled requests
speculate and repeat themselves."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import MODEL, Reference
from tests.e2e.harness import Server, launch

PROMPT = "one two three four five six. one two three four five six. one two three"


@pytest.fixture(scope="module")
def spec_server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch(engine_dir, tmp_path_factory.mktemp("spec"), args=("--speculative", "ngram:4"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


def counter(page: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", page, re.M)
    assert m, f"{name} not on /metrics"
    return float(m.group(1))


def test_greedy_completions_equal_transformers_with_drafts_accepted(
        spec_server: Server, reference: Reference) -> None:
    client = spec_server.client()
    for prompt, n in ((PROMPT, 40), ("The quick brown fox", 24)):
        want = reference.completion(prompt, n)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                        temperature=0)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == want.finish_reason
    # a sampled request speculates too (its drafts mostly rejected on a random model)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                    temperature=0.8, seed=1)
    assert got.usage is not None and got.usage.completion_tokens >= 1
    page = spec_server.metrics()
    drafted = counter(page, "llmserve_spec_decode_num_draft_tokens_total")
    accepted = counter(page, "llmserve_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    drafts = counter(page, "llmserve_spec_decode_num_drafts_total")
    assert drafts > 0 and accepted <= 4 * drafts
    # vLLM's per-position counts: position 0 counts every verify step that accepted
    # anything, and each later position no more than the one before it
    per_pos = [counter(page, f'llmserve_spec_decode_num_accepted_tokens_per_pos_total'
                             f'{{position="{i}"}}') for i in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert counter(page, "llmserve_spec_decode_draft_acceptance_rate") == pytest.approx(
        accepted / drafted)
    assert counter(page, "llmserve_spec_decode_mean_acceptance_length") == pytest.approx(
        1 + accepted / drafts)
    report = spec_server.call("GET", "/v1/engine").json()
    spec = report["speculative"]
    assert (spec["drafter"], spec["from"]) == ("ngram:4", "--speculative")
    assert spec["policy"]["policy"] == "adaptive" and spec["policy"]["max_batch_size"] >= 1


ACCEPTED = "llmserve_spec_decode_num_accepted_tokens_total"


def answer(srv: Server, **kw: Any) -> tuple[str, str | None, list[str], list[float]]:
    """A completion's text, finish reason, and its tokens' log-probabilities."""
    r = srv.client().completions.create(model=MODEL, **kw)
    c = r.choices[0]
    lp = c.logprobs
    return (c.text, c.finish_reason, list(lp.tokens or []) if lp else [],
            list(lp.token_logprobs or []) if lp else [])


CASES: list[dict[str, Any]] = [
    dict(prompt=PROMPT, max_tokens=40, temperature=0, logprobs=3),
    dict(prompt=PROMPT, max_tokens=40, temperature=0,
         extra_body={"guided_regex": "(one two three four five six\\. ){2,6}"}),
    dict(prompt=PROMPT, max_tokens=120, temperature=0, logprobs=1,
         extra_body={"guided_json": {"type": "array", "items": {"enum": ["one", "two", "three"]},
                                     "minItems": 4, "maxItems": 6}}),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=["logprobs", "guided", "json"])
def test_logprobs_and_structured_output_equal_the_plain_server_with_drafts_accepted(
        spec_server: Server, server: Server, case: int) -> None:
    kw = CASES[case]
    before = counter(spec_server.metrics(), ACCEPTED)
    text, finish, tokens, lps = answer(spec_server, **kw)
    assert counter(spec_server.metrics(), ACCEPTED) > before, "no draft accepted"
    want_text, want_finish, want_tokens, want_lps = answer(server, **kw)
    assert (text, finish, tokens) == (want_text, want_finish, want_tokens)
    # The same processed distribution, its rows from a verify step rather than a decode
    # step: equal to rounding.
    assert lps == pytest.approx(want_lps, abs=1e-4)
    if "guided_json" in kw.get("extra_body", {}):
        assert json.loads(text)


def test_stop_strings_end_where_the_plain_server_ends(spec_server: Server,
                                                      server: Server) -> None:
    full, _, _, _ = answer(server, prompt=PROMPT, max_tokens=40, temperature=0)
    stop = full[len(full) // 2:len(full) // 2 + 4]
    assert stop.strip(), full
    got = answer(spec_server, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    want = answer(server, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert got == want and got[1] == "stop"


def test_seeded_sampled_requests_repeat_with_drafts(spec_server: Server) -> None:
    kw = dict(prompt=PROMPT, max_tokens=40, temperature=0.7, seed=5, logprobs=1)
    before = counter(spec_server.metrics(), "llmserve_spec_decode_num_draft_tokens_total")
    first = answer(spec_server, **kw)
    assert counter(spec_server.metrics(),
                   "llmserve_spec_decode_num_draft_tokens_total") > before, "no draft"
    assert answer(spec_server, **kw) == first
