"""Issue 37 item 5 against the shared served TP=2 engine (batch 16), over real HTTP:
- one request with n=16 held every row, and a one-token request waited until all its
  siblings finished: now it gets a row (a sibling is recomputed later) and finishes first;
- `priority` (vLLM's: lower first): with the batch full, a request with priority -5 that
  arrives after four with priority 5 is admitted before them, when the first row frees;
- behind a long prompt (its own server, --max-prefill-tokens-while-waiting 16): a short
  prompt gets its first token before the long prompt's prefill ends.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

from tests.e2e.conftest import BUILD_ARGS, MAX_SEQ_LEN, MODEL, Reference
from tests.e2e.harness import Server, launch
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


def test_a_short_prompt_gets_its_first_token_before_a_long_prefill_ends(
        engine_dir: Path, reference: Reference, tmp_path: Path) -> None:
    """Issue 37 item 5: one completions call with [long, short] (submitted back to back):
    the long prompt takes the first step's whole budget (128 tokens) and the short one
    waits for it. In the next step, without --max-prefill-tokens-while-waiting, the long
    prompt's remaining ~100 tokens and the short prompt run together, and the long one's
    first token is streamed first; with a cap of 16 that step computes 16 of the long
    prompt's tokens and the short prompt, whose first token comes a step before the
    long one's."""
    budget = int(BUILD_ARGS[BUILD_ARGS.index("--max-num-tokens") + 1])
    words, long_prompt = 0, ""
    while len(reference.completion_ids(long_prompt)) < budget + 64:
        words += 1
        long_prompt = "Summarize: " + " ".join(f"item{i}" for i in range(words))
    assert len(reference.completion_ids(long_prompt)) + 4 <= MAX_SEQ_LEN
    srv = launch(engine_dir, tmp_path / "server",  # debug: the engine's step lines
                 args=("--max-prefill-tokens-while-waiting", "16", "--log-level", "debug"))
    try:
        srv.wait_ready()

        async def main() -> list[int]:
            client = srv.async_client()
            # logprobs: a chunk for every token, even one whose text is still held back
            stream = await client.completions.create(
                model=MODEL, prompt=[long_prompt, "Hello"], max_tokens=4, temperature=0.0,
                logprobs=0, stream=True, extra_body={"ignore_eos": True})
            first: list[int] = []  # choice indexes in the order of their first chunk
            async for chunk in stream:
                for c in chunk.choices:
                    if c.index not in first:
                        first.append(c.index)
            await client.close()
            return first

        order = asyncio.run(main())
        # The engine's own account: the step each prompt's first token was sampled in.
        lines = [line.split(" DEBUG ", 1)[1] for line in
                 (srv.run_dir / "rank0.log").read_text().splitlines()
                 if " DEBUG queued " in line or " DEBUG step " in line]
        seq = {m[1]: int(m[2]) for m in (re.match(r"queued \S+-(\d) as seq (\d+)", x)
                                          for x in lines) if m}
        steps = [(int(m[1]), dict((int(a), b) for a, _, b in (e.partition(":")
                                                               for e in m[2].split())))
                 for m in (re.match(r"step (\d+): .*\[(.*)\]", x) for x in lines) if m]
        first = {p: min(k for k, entries in steps if entries.get(sid, "").endswith("*"))
                 for p, sid in seq.items()}
        assert first["1"] < first["0"], lines
        assert order == [1, 0], lines
        gates = srv.call("GET", "/v1/engine").json()["gates"]
        admission = next(g for g in gates if g["name"] == "admission")["evidence"]
        assert admission["max_prefill_tokens_while_waiting"] == 16, admission
    finally:
        srv.close()
