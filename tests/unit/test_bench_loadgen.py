"""The load generator's statistics and stream parsing (no server, no network)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.loadgen import LoadSpec, parse_sse_line
from bench.stats import (
    RequestResult,
    chunk_token_count,
    median,
    percentile,
    summarize,
    usage_tokens,
)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    data = [0.3, 5.0, 1.2, 9.9, 2.2, 2.2, 7.1]
    assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([4.0], 99) == 4.0
    assert percentile([1.0, math.nan, 3.0], 50) == 2.0  # nan (failed request) is ignored
    assert math.isnan(percentile([math.nan, math.nan], 50))
    for q in (101, -1, math.nan):
        with pytest.raises(ValueError):
            percentile([1.0], q)


def test_median_matches_numpy_and_skips_nan() -> None:
    assert median([3.0, 1.0, math.nan, 2.0, 10.0]) == pytest.approx(float(np.median([3, 1, 2, 10])))
    assert math.isnan(median([]))


def _ok(i: int, ttft: float, itl: list[float], tokens: int) -> RequestResult:
    return RequestResult(i, ttft_s=ttft, itl_s=itl, e2e_s=ttft + sum(itl), output_tokens=tokens)


def test_summarize_throughput_and_percentiles_over_ok_requests() -> None:
    results = [
        _ok(0, 0.10, [0.02, 0.04], 3),
        _ok(1, 0.30, [0.06, 0.08], 3),
        _ok(2, 0.20, [0.01], 2),  # short: counted as a length mismatch
        RequestResult(3, error="HTTP 503: busy"),
    ]
    s = summarize(results, concurrency=2, wall_s=2.0, expected_tokens=3)
    assert s.requests == 4 and s.errors == 1 and s.first_error == "HTTP 503: busy"
    assert s.output_tokens == 8
    assert s.output_tok_s == pytest.approx(4.0)
    assert s.ttft_p50_s == pytest.approx(0.20)
    assert s.itl_p50_s == pytest.approx(0.04)
    assert s.itl_p99_s == pytest.approx(float(np.percentile([0.02, 0.04, 0.06, 0.08, 0.01], 99)))
    assert s.token_count_mismatches == 1
    with pytest.raises(ValueError):
        summarize(results, 2, 0.0, 3)


def test_stream_chunks_count_tokens_and_usage() -> None:
    text_chunk = parse_sse_line(b'data: {"choices":[{"text":" hi","index":0}]}\n')
    assert text_chunk is not None and chunk_token_count(text_chunk) == 1
    empty = parse_sse_line(b'data: {"choices":[{"text":"","finish_reason":"length"}]}')
    assert empty is not None and chunk_token_count(empty) == 0
    ids = {"choices": [{"text": "ab", "token_ids": [5, 6]}]}
    assert chunk_token_count(ids) == 2
    usage = parse_sse_line(b'data: {"choices":[],"usage":{"completion_tokens":128}}')
    assert usage is not None and chunk_token_count(usage) == 0 and usage_tokens(usage) == 128
    assert parse_sse_line(b"data: [DONE]") is None
    assert parse_sse_line(b": ping") is None
    assert parse_sse_line(b"\n") is None


def test_loadspec_refuses_non_local_targets_and_unbounded_runs() -> None:
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        LoadSpec("http://example.com:80", prompts=["x"])
    with pytest.raises(ValueError):
        LoadSpec("http://127.0.0.1:8000", prompts=["x"], num_requests=10**6)
    with pytest.raises(ValueError):
        LoadSpec("http://127.0.0.1:8000", prompts=["x"], concurrency=0)
    LoadSpec("http://localhost:8000", prompts=[[1, 2, 3]], concurrency=4, num_requests=8)
