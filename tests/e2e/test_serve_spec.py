"""Speculative decoding through the HTTP server: `serve launch --speculative ngram:4` on the
session's TP=2 engine answers greedy requests exactly as transformers does (the prompt
repeats itself, so drafts are verified and accepted), counts drafts on /metrics and shows
the drafter on /v1/engine."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

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
    # a sampled request decodes one token at a time and still answers
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
