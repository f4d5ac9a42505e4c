"""Per-request measurements of a load run and their summary (throughput, percentiles)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class RequestResult:
    """One streamed request. Times are seconds; start_s is relative to the run's start."""

    index: int
    start_s: float = 0.0
    ttft_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    e2e_s: float = math.nan
    output_tokens: int = 0
    chunks: int = 0
    error: str | None = None
    text: str = ""  # the streamed completion, for comparing two servers' outputs

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class LoadSummary:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    e2e_p50_s: float
    token_count_mismatches: int  # ok requests whose output length is not the requested one
    first_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """numpy's q-th percentile (0..100, linear interpolation) over the non-nan values; nan if none.

    nan marks a failed request's latency, so it is left out rather than poisoning the result.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = np.asarray(values, dtype=float)
    data = data[~np.isnan(data)]
    return float(np.percentile(data, q)) if data.size else math.nan


def median(values: list[float]) -> float:
    return percentile(values, 50.0)


def summarize(
    results: list[RequestResult], concurrency: int, wall_s: float, expected_tokens: int
) -> LoadSummary:
    """Throughput over the whole run's wall time; latency percentiles over ok requests only."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be positive, got {wall_s}")
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itls = [gap for r in ok for gap in r.itl_s]
    return LoadSummary(
        concurrency=concurrency,
        requests=len(results),
        errors=len(errors),
        wall_s=wall_s,
        output_tokens=tokens,
        output_tok_s=tokens / wall_s,
        ttft_p50_s=percentile([r.ttft_s for r in ok], 50),
        ttft_p99_s=percentile([r.ttft_s for r in ok], 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        e2e_p50_s=percentile([r.e2e_s for r in ok], 50),
        token_count_mismatches=sum(1 for r in ok if r.output_tokens != expected_tokens),
        first_error=errors[0].error if errors else None,
    )


def chunk_token_count(chunk: dict[str, Any]) -> int:
    """How many new tokens one streamed /v1/completions chunk carries.

    Token ids when the server sends them (llama-server `tokens` with return_tokens, vLLM
    `token_ids` with return_token_ids); otherwise one token per chunk with text, which is
    what every OpenAI-style server streams in decode (one chunk per step per request).
    """
    if isinstance(chunk.get("tokens"), list):
        return len(chunk["tokens"])
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    return 1 if choice.get("text") else 0


def usage_tokens(chunk: dict[str, Any]) -> int | None:
    """completion_tokens from a chunk's `usage`, when the server reports it."""
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return None
