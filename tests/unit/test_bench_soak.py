"""The soak's bookkeeping: how an answer is classified, and the /metrics reader (no server)."""

from __future__ import annotations

import random

import pytest

from bench.job import metric, metric_sum, parse_metrics
from bench.traffic import StreamState, _check_answer, _classify_status, _event
from bench.traffic_mix import Req, RequestMaker, Result, Workload

PAGE = """# HELP llmserve_kv_cache_blocks Paged KV-cache blocks by state
# TYPE llmserve_kv_cache_blocks gauge
llmserve_kv_cache_blocks{state="used"} 0.0
llmserve_kv_cache_blocks{state="cached"} 12.0
llmserve_http_requests_total{route="/v1/completions",status="200"} 7.0
llmserve_http_requests_total{route="/v1/chat/completions",status="503"} 2.0
llmserve_http_requests_total{route="/v1/completions",status="500"} 1.0
llmserve_http_requests_total{route="/v1/completions",status="429"} 4.0
llmserve_num_requests_running 0.0
"""


def test_metrics_reader_sums_series_by_label_pattern() -> None:
    page = parse_metrics(PAGE)
    assert metric(page, "llmserve_kv_cache_blocks", state="cached") == 12
    assert metric(page, "llmserve_num_requests_running") == 0
    assert metric(page, "llmserve_kv_cache_blocks", state="free") is None
    assert metric_sum(page, "llmserve_http_requests_total", status=r"5\d\d") == 3
    assert metric_sum(page, "llmserve_http_requests_total", route=r"/v1/completions") == 12


def _req(expect: str = "ok", max_tokens: int = 4, stream: bool = False) -> Req:
    return Req("completion", "/v1/completions",
               {"prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": stream}, 3, expect)


def _res(req: Req) -> Result:
    return Result(0, req.kind, req.stream, req.expect, req.action, False, 0.0)


@pytest.mark.parametrize(("status", "headers", "text", "expect", "outcome"), [
    (429, {"Retry-After": "1"}, "queue_full", "ok", "rejected"),
    (429, {}, "queue_full", "ok", "unexpected"),  # a 429 must say when to come back
    (503, {}, "draining", "ok", "5xx"),
    (400, {}, "context_length_exceeded", "400", "invalid"),
    (400, {}, "context_length_exceeded", "ok", "unexpected"),  # a valid request refused
    (400, {}, "invalid_value", "400", "unexpected"),  # refused for the wrong reason
])
def test_statuses_are_classified(status: int, headers: dict[str, str], text: str, expect: str,
                                 outcome: str) -> None:
    req = _req(expect)
    res = _res(req)
    assert _classify_status(req, res, status, headers, text)
    assert res.outcome == outcome


def test_a_200_for_a_request_over_the_limit_is_unexpected() -> None:
    req = _req("400")
    res = _res(req)
    assert _classify_status(req, res, 200, {}, "")
    assert res.outcome == "unexpected"


@pytest.mark.parametrize(("finish", "usage", "outcome"), [
    ("length", {"prompt_tokens": 3, "completion_tokens": 4}, "complete"),
    ("stop", {"prompt_tokens": 3, "completion_tokens": 2}, "complete"),
    ("length", {"prompt_tokens": 3, "completion_tokens": 3}, "unexpected"),  # stopped short
    ("stop", {"prompt_tokens": 3, "completion_tokens": 5}, "unexpected"),  # over max_tokens
    ("stop", {"prompt_tokens": 9, "completion_tokens": 1}, "unexpected"),  # wrong prompt count
    (None, {"prompt_tokens": 3, "completion_tokens": 1}, "unexpected"),
])
def test_answers_are_checked_against_the_request(finish: str | None, usage: dict[str, int],
                                                 outcome: str) -> None:
    req = _req(max_tokens=4)
    res = _res(req)
    _check_answer(req, res, {"choices": [{"text": "x", "finish_reason": finish}],
                             "usage": usage})
    assert res.outcome == outcome


def test_a_stream_needs_done_and_an_in_band_server_error_is_a_5xx() -> None:
    req = _req(stream=True, max_tokens=2)
    st = StreamState()
    for line in (b'data: {"choices":[{"text":"a","finish_reason":null}]}',
                 b'data: {"choices":[{"text":"b","finish_reason":"length"}]}', b""):
        st.feed(_event(line))
    res = _res(req)
    st.settle(req, res)
    assert (res.outcome, res.detail) == ("unexpected", "stream ended without [DONE]")
    st.feed(_event(b"data: [DONE]"))
    res = _res(req)
    st.settle(req, res)
    assert res.outcome == "complete" and st.chunks == 2
    st = StreamState()
    st.feed(_event(b'data: {"error":{"type":"server_error","message":"boom"}}'))
    res = _res(req)
    st.settle(req, res)
    assert res.outcome == "5xx"


class _Tok:
    """A stand-in tokenizer: one token per word, a 5-token chat template."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [1] * len(text.split())}

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> list[int]:
        return [1] * (5 + sum(len(m["content"].split()) for m in messages))


def test_requests_drawn_respect_the_context_limit_as_labelled() -> None:
    work = Workload(max_seq_len=128, vocab=1000, max_queue=4)
    maker = RequestMaker(_Tok(), work, "m", random.Random(0))
    for _ in range(500):
        req = maker.next()
        room = work.max_seq_len - req.prompt_tokens
        if req.expect == "400":
            assert req.prompt_tokens >= work.max_seq_len or req.body["max_tokens"] > room
        else:
            assert 1 <= req.body["max_tokens"] <= room, req
        if req.kind == "at_limit":
            assert req.body["max_tokens"] == room
        if isinstance(req.body.get("prompt"), list):
            assert len(req.body["prompt"]) == req.prompt_tokens
            assert all(100 <= t < work.vocab for t in req.body["prompt"])


def test_rss_plateau_judges_the_second_half_against_the_middle() -> None:
    from bench.soak import rss_plateau

    def series(values: list[int]) -> list[dict[str, object]]:
        return [{"t": 60.0 * i, "rss_kib": {0: v}} for i, v in enumerate(values)]

    # Grows in the first half (caches filling), flat in the second: a plateau.
    flat = rss_plateau(series([500_000, 700_000, 800_000, 805_000, 808_000]), 240.0)[0]
    assert flat["mid_kib"] == 800_000 and flat["second_half_kib"] == 8_000
    assert flat["second_half_pct"] == 1.0 and flat["ok"]
    # Still growing 60 MiB in the second half: a leak, or an unbounded cache.
    leak = rss_plateau(series([500_000, 560_000, 620_000, 680_000, 740_000]), 240.0)[0]
    assert leak["second_half_kib"] == 120_000 and not leak["ok"]
