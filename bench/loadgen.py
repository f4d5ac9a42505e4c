"""The project's own asyncio load generator for OpenAI-style /v1/completions servers.

N workers share a fixed number of streamed requests; every chunk is timed, so TTFT and
inter-token latency come from what the client sees. Output length is forced to exactly
`max_tokens` where the server supports it (`ignore_eos`, vLLM's `min_tokens`), and the
token count per request comes from the stream (the final `usage` when the server sends it).

Bounded on purpose: only 127.0.0.1/localhost targets, at most MAX_REQUESTS requests and
MAX_CONCURRENCY workers, a timeout per request and for the whole run.

    python -m bench.loadgen --url http://127.0.0.1:8080 --hf-dir DIR -c 16 -n 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bench.stats import LoadSummary, RequestResult, chunk_token_count, summarize, usage_tokens

MAX_REQUESTS = 4096
MAX_CONCURRENCY = 256
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost"})

Prompt = str | list[int]


@dataclass(frozen=True)
class LoadSpec:
    base_url: str  # e.g. http://127.0.0.1:8080 (no /v1)
    prompts: Sequence[Prompt]  # request i uses prompts[i % len(prompts)]
    max_tokens: int = 128
    concurrency: int = 1
    num_requests: int = 1
    model: str | None = None  # None: the first id of GET /v1/models
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 300.0
    total_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme != "http" or parts.hostname not in LOCAL_HOSTS:
            raise ValueError(f"only http://127.0.0.1 targets are allowed, got {self.base_url!r}")
        if not self.prompts:
            raise ValueError("at least one prompt is needed")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be in [1, {MAX_CONCURRENCY}]")
        if not 1 <= self.num_requests <= MAX_REQUESTS:
            raise ValueError(f"num_requests must be in [1, {MAX_REQUESTS}]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.request_timeout_s <= 0 or self.total_timeout_s <= 0:
            raise ValueError("timeouts must be positive")


def exact_length_body(max_tokens: int) -> dict[str, Any]:
    """Fields that make llama-server, vLLM and our server generate exactly max_tokens.

    Unknown fields are ignored by all three; `min_tokens` is vLLM's, `ignore_eos` all three.
    """
    return {"ignore_eos": True, "min_tokens": max_tokens}


async def fetch_model_id(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        data = await resp.json(content_type=None)
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


def parse_sse_line(raw: bytes) -> dict[str, Any] | None:
    """One SSE line to a JSON chunk; None for blank lines, comments, non-data and [DONE]."""
    line = raw.decode("utf-8", errors="replace").strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if not payload or payload == "[DONE]":
        return None
    obj = json.loads(payload)
    return obj if isinstance(obj, dict) else None


async def _one_request(
    session: aiohttp.ClientSession, spec: LoadSpec, model: str, index: int, t0: float
) -> RequestResult:
    result = RequestResult(index=index)
    body: dict[str, Any] = {
        "model": model,
        "prompt": spec.prompts[index % len(spec.prompts)],
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **spec.extra_body,
    }
    start = time.perf_counter()
    result.start_s = start - t0
    last = start
    reported: int | None = None
    try:
        timeout = aiohttp.ClientTimeout(total=spec.request_timeout_s)
        async with session.post(f"{spec.base_url}/v1/completions", json=body, timeout=timeout) as r:
            if r.status != 200:
                text = (await r.text())[:300]
                result.error = f"HTTP {r.status}: {text}"
                return result
            async for raw in r.content:
                chunk = parse_sse_line(raw)
                if chunk is None:
                    continue
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                reported = usage_tokens(chunk) if usage_tokens(chunk) is not None else reported
                n = chunk_token_count(chunk)
                for choice in chunk.get("choices") or []:
                    result.text += choice.get("text") or ""
                if n == 0:
                    continue
                now = time.perf_counter()
                if result.chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                result.chunks += 1
                result.output_tokens += n
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.e2e_s = time.perf_counter() - start
    if reported is not None:
        result.output_tokens = reported
    if result.chunks == 0:
        result.error = "stream ended without any token"
    return result


async def run_load_async(spec: LoadSpec) -> tuple[list[RequestResult], LoadSummary]:
    # A fresh connection per request: some servers (llama-server's httplib) close a streamed
    # response's connection, and a reused keep-alive socket then fails as "disconnected".
    connector = aiohttp.TCPConnector(limit=spec.concurrency, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = spec.model or await fetch_model_id(session, spec.base_url)
        results: list[RequestResult] = []
        next_index = iter(range(spec.num_requests))
        t0 = time.perf_counter()

        async def worker() -> None:
            # Single-threaded event loop: taking the next index from a shared iterator is safe.
            for index in next_index:
                results.append(await _one_request(session, spec, model, index, t0))

        workers = [asyncio.create_task(worker()) for _ in range(spec.concurrency)]
        try:
            await asyncio.wait_for(asyncio.gather(*workers), timeout=spec.total_timeout_s)
        except asyncio.TimeoutError:
            for w in workers:
                w.cancel()
            done = {r.index for r in results}
            results.extend(
                RequestResult(index=i, error=f"run exceeded {spec.total_timeout_s:.0f} s")
                for i in range(spec.num_requests)
                if i not in done
            )
        wall = max(time.perf_counter() - t0, 1e-9)
    results.sort(key=lambda r: r.index)
    return results, summarize(results, spec.concurrency, wall, spec.max_tokens)


def run_load(spec: LoadSpec) -> tuple[list[RequestResult], LoadSummary]:
    return asyncio.run(run_load_async(spec))


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", required=True, help="http://127.0.0.1:PORT")
    ap.add_argument("--hf-dir", type=Path, required=True, help="tokenizer for the prompts")
    ap.add_argument("-c", "--concurrency", type=int, default=1)
    ap.add_argument("-n", "--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", action="store_true", help="send prompts as text, not token ids")
    args = ap.parse_args(argv)
    from bench.prompts import load_tokenizer, make_prompts

    tok = load_tokenizer(args.hf_dir)
    ids = make_prompts(tok, args.requests, args.prompt_len, seed=args.seed)
    prompts: list[Prompt] = [tok.decode(p) for p in ids] if args.text else list(ids)
    try:
        spec = LoadSpec(
            base_url=args.url.rstrip("/"),
            prompts=prompts,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            num_requests=args.requests,
            extra_body=exact_length_body(args.max_tokens),
        )
        _, summary = run_load(spec)
    except (ValueError, RuntimeError, aiohttp.ClientError) as exc:
        print(f"loadgen: error: {exc}")
        return 2
    print(json.dumps(summary.to_dict(), indent=2))
    return 0 if summary.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(_main())
