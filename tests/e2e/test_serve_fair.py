"""Issue 37 item 5 against the shared served TP=2 engine (batch 16), over real HTTP:
- one request with n=16 held every row, and a one-token request waited until all its
  siblings finished: now it gets a row (a sibling is recomputed later) and finishes first;
- `priority` (vLLM's: lower first): with the batch full, a request with priority -5 that
  arrives after four with priority 5 is admitted before them, when the first row frees.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.e2e.conftest import MODEL
from tests.e2e.harness import Server
from tests.unit.test_metrics import parse as parse_metrics

BATCH = 16  # the shared engine's --max-batch-size


def _gauge(srv: Server, name: str) -> float:
    return parse_metrics(srv.metrics()).value(name)


async def _until(srv: Server, name: str, at_least: float, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while _gauge(srv, name) < at_least:
        assert time.monotonic() < end, f"{name} never reached {at_least}"
        await asyncio.sleep(0.05)


async def _complete(client: Any, done: dict[str, float], tag: str, prompt: str,
                    max_tokens: int, **extra: Any) -> Any:
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0.0, extra_body=extra)
    done[tag] = time.monotonic()
    return out


def test_one_request_with_n_16_does_not_hold_every_row(server: Server) -> None:
    async def main() -> dict[str, float]:
        client = server.async_client()
        done: dict[str, float] = {}
        big = asyncio.create_task(_complete(client, done, "n16", "Once upon a time", 150,
                                            n=BATCH, ignore_eos=True))
        await _until(server, "llmserve_num_requests_running", BATCH)
        small = await _complete(client, done, "one", "Hello", 1)
        assert small.choices[0].finish_reason == "length"
        result = await big
        assert len(result.choices) == BATCH
        assert all(c.finish_reason == "length" for c in result.choices)
        assert result.usage.completion_tokens == BATCH * 150
        await client.close()
        return done

    done = asyncio.run(main())
    assert done["one"] < done["n16"]


def test_a_high_priority_request_overtakes_queued_low_ones(server: Server) -> None:
    async def main() -> dict[str, float]:
        client = server.async_client()
        done: dict[str, float] = {}
        # Fill the batch; rows free one at a time, every 6 tokens from the 60th.
        fill = [asyncio.create_task(_complete(client, done, f"fill{i}", f"Story {i}:",
                                              60 + 6 * i, ignore_eos=True))
                for i in range(BATCH)]
        await _until(server, "llmserve_num_requests_running", BATCH)
        low = [asyncio.create_task(_complete(client, done, f"low{i}", f"Low {i}:", 2,
                                             priority=5, ignore_eos=True))
               for i in range(4)]
        await _until(server, "llmserve_num_requests_waiting", 4)
        high = asyncio.create_task(_complete(client, done, "high", "High:", 2, priority=-5,
                                             ignore_eos=True))
        await asyncio.gather(*fill, *low, high)
        await client.close()
        return done

    done = asyncio.run(main())
    assert done["high"] < min(done[f"low{i}"] for i in range(4)), done
    assert done["high"] < done[f"fill{BATCH - 1}"]


def test_priority_must_be_an_integer(server: Server) -> None:
    for value in ("high", 1.5, True, 2**31):
        reply = server.call("POST", "/v1/completions",
                            {"model": MODEL, "prompt": "x", "priority": value})
        assert reply.status == 400, reply
        assert reply.json()["error"]["param"] == "priority"
