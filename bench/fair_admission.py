"""Fair admission (issue #37 item 5), measured on a served engine over HTTP.

    python -m bench.fair_admission --engine ENGINE_DIR [--tp 1] [--rounds 5]

Two scenarios, each repeated `rounds` times on one server:
- behind a long prompt: a ~1,000-token prompt is sent, then 50 ms later a one-word prompt;
  the short request's time to first token (streamed) is reported, with the long one's.
- behind n=16: a request with n=16, ignore_eos, max_tokens=300 runs; once its siblings
  hold the batch, a one-token request is sent; its latency is reported.
Run it on two checkouts (before, after) to compare; it prints JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.e2e.harness import launch
from tests.unit.test_metrics import parse as parse_metrics


async def _ttft(client: Any, model: str, prompt: str, max_tokens: int, **extra: Any
                ) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of one streamed completion."""
    t0 = time.monotonic()
    first = None
    stream = await client.completions.create(model=model, prompt=prompt,
                                             max_tokens=max_tokens, temperature=0.0,
                                             stream=True, extra_body=extra)
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic() - t0
    end = time.monotonic() - t0
    return (first if first is not None else end), end


async def _long_prompt_round(client: Any, model: str, long_prompt: str) -> dict[str, float]:
    long_task = asyncio.create_task(_ttft(client, model, long_prompt, 8))
    await asyncio.sleep(0.05)
    short_first, _ = await _ttft(client, model, "Hello", 4)
    long_first, _ = await long_task
    return {"short_ttft_s": short_first, "long_ttft_s": long_first}


async def _n16_round(client: Any, model: str, metrics: Any) -> dict[str, float]:
    big = asyncio.create_task(client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=120, n=16, temperature=0.8,
        extra_body={"ignore_eos": True}))
    t0 = time.monotonic()
    while parse_metrics(metrics()).value("llmserve_num_requests_running") < 16:
        await asyncio.sleep(0.02)
        if time.monotonic() - t0 > 60:
            raise RuntimeError("n=16 never filled the batch")
    _, short_end = await _ttft(client, model, "Hello", 1)
    t1 = time.monotonic()
    await big
    return {"one_token_latency_s": short_end, "n16_rest_s": time.monotonic() - t1}


async def _main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        srv = launch(Path(args.engine), Path(tmp), n=args.tp)
        try:
            srv.wait_ready(timeout=300)
            client = srv.async_client(timeout=600)
            model = (await client.models.list()).data[0].id
            words = " ".join(f"word{i}" for i in range(args.long_words))
            await _ttft(client, model, "warm up", 2)
            # Each round's long prompt starts differently: the prefix cache would otherwise
            # serve every round after the first from the first's blocks.
            for name, fn in (("long_prompt", lambda r: _long_prompt_round(
                                 client, model, f"List {r}. Summarize this list: {words}")),
                             ("n16", lambda r: _n16_round(client, model, srv.metrics))):
                runs = [await fn(r) for r in range(args.rounds)]
                summary = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
                print(json.dumps({"scenario": name, "median": summary,
                                  "runs": [{k: round(v, 3) for k, v in r.items()}
                                           for r in runs]}), flush=True)
            await client.close()
        finally:
            srv.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--long-words", type=int, default=275,
                    help="words in the long prompt (275: 996 tokens on SmolLM2)")
    asyncio.run(_main(ap.parse_args()))


if __name__ == "__main__":
    main()
