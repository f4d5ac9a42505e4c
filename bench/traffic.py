"""The soak's traffic: a mix of requests of every shape a server meets, each one checked.

Streaming and non-streaming completions and chat completions with random prompt lengths up
to the context limit (some exactly at it, some over it expecting a 400), random max_tokens,
greedy and sampled, some with stop strings; clients that close a stream early (a cancel),
that give up on a non-streamed request, and that reset the TCP connection mid-stream; and
bursts larger than --max-queue, expecting 429 with Retry-After.

Every request ends in exactly one outcome:
  complete   200 and a finish reason (and `data: [DONE]` for a stream), usage consistent
  cancelled  we closed or reset the connection before the end (on purpose)
  rejected   429 with a Retry-After header
  invalid    400 context_length_exceeded, for a request built to exceed the limit
  5xx        any status >= 500, or an in-band error event of a 200 stream
  unexpected anything else: a 400 for a valid request, a 200 for an invalid one, a
             connection the server dropped, a malformed or inconsistent answer, a timeout
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.traffic_mix import Req, RequestMaker, Result, Workload

# ---- sending ------------------------------------------------------------------------------


def _check_answer(req: Req, res: Result, body: dict[str, Any]) -> None:
    """A complete non-streamed answer: finish reason and usage must agree with the request."""
    choices = body.get("choices") or []
    usage = body.get("usage") or {}
    if len(choices) != 1:
        res.outcome, res.detail = "unexpected", f"{len(choices)} choices"
        return
    finish = choices[0].get("finish_reason")
    res.finish_reason = finish
    res.completion_tokens = int(usage.get("completion_tokens", -1))
    _check_usage(req, res, finish, usage)


def _check_usage(req: Req, res: Result, finish: str | None, usage: dict[str, Any] | None) -> None:
    max_tokens = int(req.body["max_tokens"])
    if finish not in ("stop", "length"):
        res.outcome, res.detail = "unexpected", f"finish_reason {finish!r}"
    elif usage is not None and usage.get("prompt_tokens") != req.prompt_tokens:
        res.outcome = "unexpected"
        res.detail = f"prompt_tokens {usage.get('prompt_tokens')} != {req.prompt_tokens}"
    elif usage is not None and not 0 <= res.completion_tokens <= max_tokens:
        res.outcome = "unexpected"
        res.detail = f"completion_tokens {res.completion_tokens} > max_tokens {max_tokens}"
    elif usage is not None and finish == "length" and res.completion_tokens != max_tokens:
        res.outcome = "unexpected"
        res.detail = f"finish length after {res.completion_tokens} of {max_tokens} tokens"
    else:
        res.outcome = "complete"


def _classify_status(req: Req, res: Result, status: int, headers: Any, text: str) -> bool:
    """Non-200 statuses; True when the request is settled by its status alone."""
    res.status = status
    if status == 200:
        if req.expect == "400":
            res.outcome, res.detail = "unexpected", "200 for a request over the context limit"
            return True
        return False
    res.detail = text[:300]
    if status == 429:
        res.retry_after = headers.get("Retry-After") or headers.get("retry-after")
        res.outcome = "rejected" if res.retry_after else "unexpected"
        if not res.retry_after:
            res.detail = "429 without Retry-After: " + res.detail
    elif status >= 500:
        res.outcome = "5xx"
    elif status == 400 and req.expect == "400" and "context_length_exceeded" in text:
        res.outcome = "invalid"
    else:
        res.outcome = "unexpected"
    return True


def _event(line: bytes) -> dict[str, Any] | str | None:
    """One SSE line: a JSON chunk, "[DONE]", or None (blank, comment, not data)."""
    text = line.decode("utf-8", errors="replace").strip()
    if not text.startswith("data:"):
        return None
    payload = text[5:].strip()
    if payload == "[DONE]":
        return payload
    obj = json.loads(payload)
    return obj if isinstance(obj, dict) else None


class StreamState:
    """What a stream said so far."""

    def __init__(self) -> None:
        self.chunks = 0  # chunks carrying text
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.error: dict[str, Any] | None = None

    def feed(self, ev: dict[str, Any] | str | None) -> None:
        if ev is None:
            return
        if ev == "[DONE]":
            self.done = True
            return
        assert isinstance(ev, dict)
        if "error" in ev:
            self.error = ev["error"]
            return
        for choice in ev.get("choices") or []:
            delta = choice.get("delta") or {}
            if choice.get("text") or delta.get("content"):
                self.chunks += 1
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        if ev.get("usage"):
            self.usage = ev["usage"]

    def settle(self, req: Req, res: Result) -> None:
        if self.error is not None:
            kind = str(self.error.get("type", ""))
            res.outcome = "5xx" if kind == "server_error" else "unexpected"
            res.detail = f"in-band error: {json.dumps(self.error)[:300]}"
            return
        if not self.done:
            res.outcome, res.detail = "unexpected", "stream ended without [DONE]"
            return
        res.finish_reason = self.finish
        if self.usage is not None:
            res.completion_tokens = int(self.usage.get("completion_tokens", -1))
        _check_usage(req, res, self.finish, self.usage)


async def send_http(session: aiohttp.ClientSession, base: str, req: Req, res: Result,
                    timeout_s: float) -> None:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(base + req.path, json=req.body, timeout=timeout) as resp:
        if _classify_status(req, res, resp.status, resp.headers,
                            "" if resp.status == 200 else await resp.text()):
            return
        if not req.stream:
            _check_answer(req, res, await resp.json(content_type=None))
            return
        st = StreamState()
        async for line in resp.content:
            st.feed(_event(line))
            if req.action == "cancel" and st.chunks >= req.k and not st.done:
                resp.close()  # the client closes the stream early: an explicit cancel
                res.outcome, res.detail = "cancelled", f"closed after {st.chunks} chunks"
                res.completion_tokens = st.chunks
                return
        st.settle(req, res)


async def send_rst(host: str, port: int, req: Req, res: Result, timeout_s: float) -> None:
    """A raw HTTP/1.1 stream whose client dies after `k` data lines: the connection is reset
    (SO_LINGER 0), as when a client process is killed or a NAT drops it."""
    payload = json.dumps(req.body).encode()
    head = (f"POST {req.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n").encode()

    async def run() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head + payload)
            await writer.drain()
            status_line = await reader.readline()
            status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if status != 200:
                text = (await reader.read(4096)).decode(errors="replace")
                _classify_status(req, res, status, headers, text)
                return
            res.status = 200
            st = StreamState()
            while not st.done:
                if st.chunks >= req.k and st.error is None:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()  # RST, no FIN
                    res.outcome, res.detail = "cancelled", f"reset after {st.chunks} chunks"
                    return
                line = await reader.readline()
                if not line:
                    break
                with contextlib.suppress(ValueError):
                    st.feed(_event(line))
            st.settle(req, res)
        finally:
            writer.close()

    await asyncio.wait_for(run(), timeout_s)


async def send(session: aiohttp.ClientSession, host: str, port: int, req: Req, res: Result,
               timeout_s: float) -> None:
    """Send one request and settle `res`; never raises."""
    try:
        if req.action == "rst":
            await send_rst(host, port, req, res, timeout_s)
        elif req.action == "abort":
            try:
                await asyncio.wait_for(send_http(session, f"http://{host}:{port}", req, res,
                                                 timeout_s), req.t)
            except asyncio.TimeoutError:
                if res.status in (0, 200):
                    res.outcome, res.detail = "cancelled", f"gave up after {req.t} s"
        else:
            await send_http(session, f"http://{host}:{port}", req, res, timeout_s)
    except asyncio.TimeoutError:
        res.outcome, res.detail = "unexpected", f"no answer within {timeout_s:.0f} s (hang?)"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        res.outcome, res.detail = "unexpected", f"{type(exc).__name__}: {exc}"[:300]


# ---- the run ------------------------------------------------------------------------------


@dataclass
class TrafficReport:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    bursts: int = 0
    stopped_by: str = ""

    def counts(self) -> Counter[str]:
        return Counter(r.outcome for r in self.results)


async def run_traffic(host: str, port: int, maker: RequestMaker, work: Workload,
                      duration_s: float, concurrency: int, max_requests: int,
                      on_tick: Callable[[TrafficReport, float], None] | None = None,
                      tick_s: float = 15.0) -> TrafficReport:
    """Steady traffic from `concurrency` clients plus periodic bursts, for `duration_s` or
    `max_requests` requests, then waits (bounded) for what is still in flight."""
    rep = TrafficReport()
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    counter = iter(range(max_requests))
    connector = aiohttp.TCPConnector(limit=0)
    pending: set[asyncio.Task[None]] = set()

    def start(req: Req, burst: bool) -> tuple[Result, Any] | None:
        index = next(counter, None)
        if index is None:
            rep.stopped_by = rep.stopped_by or f"max requests ({max_requests})"
            return None
        res = Result(index, req.kind, req.stream, req.expect, req.action, burst,
                     round(time.monotonic() - t0, 3))
        rep.results.append(res)
        return res, req

    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(req: Req, res: Result) -> None:
            await send(session, host, port, req, res, work.request_timeout_s)
            res.end_s = round(time.monotonic() - t0, 3)

        async def client() -> None:
            while time.monotonic() < stop_at:
                got = start(maker.next(), burst=False)
                if got is None:
                    return
                await one(got[1], got[0])
                if got[0].outcome == "rejected":  # a polite client honours Retry-After
                    with contextlib.suppress(ValueError, TypeError):
                        await asyncio.sleep(min(float(got[0].retry_after or 1), 5.0))

        async def bursts() -> None:
            next_burst = t0 + min(work.burst_every_s, duration_s / 3)
            while True:
                await asyncio.sleep(max(0.0, next_burst - time.monotonic()))
                if time.monotonic() >= stop_at:
                    return
                batch = [start(maker.burst_request(), burst=True) for _ in range(work.burst_size)]
                tasks = [asyncio.create_task(one(g[1], g[0])) for g in batch if g is not None]
                pending.update(tasks)
                for t in tasks:
                    t.add_done_callback(pending.discard)
                rep.bursts += 1
                next_burst += work.burst_every_s

        async def ticker() -> None:
            loop = asyncio.get_running_loop()
            while on_tick is not None:  # it reads /proc and /metrics: off the event loop
                await asyncio.sleep(tick_s)
                await loop.run_in_executor(None, on_tick, rep, time.monotonic() - t0)

        clients = [asyncio.create_task(client()) for _ in range(concurrency)]
        side = [asyncio.create_task(bursts()), asyncio.create_task(ticker())]
        # Clients stop starting requests at the deadline; each finishes its last one.
        limit = duration_s + work.request_timeout_s + 30
        _, not_done = await asyncio.wait(clients, timeout=limit)
        if pending:
            await asyncio.wait(list(pending), timeout=work.request_timeout_s + 30)
        for task in [*not_done, *pending, *side]:
            task.cancel()
        await asyncio.gather(*not_done, *pending, *side, return_exceptions=True)
        for res in rep.results:
            if res.end_s == 0.0 or res.outcome == "pending":
                res.outcome, res.detail = "unexpected", "still running when the soak ended"
    rep.wall_s = time.monotonic() - t0
    rep.stopped_by = rep.stopped_by or f"duration ({duration_s:.0f} s)"
    return rep
