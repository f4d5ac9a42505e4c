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
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wise", "owls", "count", "silver", "stars", "above", "quiet", "rivers", "and", "distant",
    "mountains", "echo", "old", "songs", "of", "rain", "wind", "fire", "stone", "bread", "salt",
    "iron", "glass", "paper", "music", "river", "forest", "ocean", "garden", "winter", "summer",
    "engine", "kernel", "matrix", "vector", "tensor", "token", "block", "cache", "queue",
    "batch", "stream",
)
SHARED_PREFIX_LEN = 64  # tokens shared by a third of the prompts: the prefix cache is used
OUTCOMES = ("complete", "cancelled", "rejected", "invalid", "5xx", "unexpected")


@dataclass
class Req:
    """One request to send and what to expect of it."""

    kind: str  # label in the report
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    prompt_tokens: int  # as the server will count them
    expect: str = "ok"  # "ok" (200) or "400" (context_length_exceeded)
    action: str = "read"  # read | cancel (close after `k` chunks) | abort (after `t` s) | rst
    k: int = 0
    t: float = 0.0

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Result:
    index: int
    kind: str
    stream: bool
    expect: str
    action: str
    burst: bool
    start_s: float
    end_s: float = 0.0
    status: int = 0
    outcome: str = "pending"  # until settled: one of OUTCOMES
    detail: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    retry_after: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    max_seq_len: int
    vocab: int  # token ids are drawn below this
    max_queue: int
    request_timeout_s: float = 180.0
    max_tokens_cap: int = 48  # usual max_tokens draw: 1..cap
    long_tokens: int = 160  # streams that get cancelled or reset run this long
    burst_size: int = 24
    burst_every_s: float = 25.0


class RequestMaker:
    """Draws random requests; counts prompt tokens exactly as the server will."""

    def __init__(self, tokenizer: Any, work: Workload, model: str, rng: random.Random) -> None:
        self.tok, self.w, self.model, self.rng = tokenizer, work, model, rng
        self.prefix = [rng.randrange(100, work.vocab) for _ in range(SHARED_PREFIX_LEN)]

    # ---- prompts -------------------------------------------------------------------

    def ids(self, n: int) -> list[int]:
        """n token ids; a third of them start with the shared prefix."""
        r = self.rng
        head = self.prefix[: min(n, SHARED_PREFIX_LEN)] if r.random() < 0.33 else []
        return head + [r.randrange(100, self.w.vocab) for _ in range(n - len(head))]

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def chat_len(self, messages: list[dict[str, str]]) -> int:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
        if isinstance(out, dict):
            out = out["input_ids"]
        return len(out)

    def text_len(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=True)["input_ids"])

    def messages(self, n_words: int) -> list[dict[str, str]]:
        msgs = []
        if self.rng.random() < 0.5:
            msgs.append({"role": "system", "content": "You are a terse assistant."})
        msgs.append({"role": "user", "content": self.words(max(1, n_words))})
        return msgs

    # ---- bodies --------------------------------------------------------------------

    def sampling(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.rng
        body["model"] = self.model
        if r.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=round(r.uniform(0.3, 1.2), 2), top_p=0.9,
                        seed=r.randrange(2**31))
            if r.random() < 0.3:
                body["top_k"] = 40
        if r.random() < 0.1:
            body["stop"] = ["\n", "."]
        if r.random() < 0.2:
            body["ignore_eos"] = True
        return body

    def max_tokens(self, room: int) -> int:
        return max(1, min(room, self.rng.randint(1, self.w.max_tokens_cap)))

    def completion(self, stream: bool, n: int | None = None) -> Req:
        L, r = self.w.max_seq_len, self.rng
        n = n if n is not None else r.randint(1, L - 1)
        if r.random() < 0.15:  # a text prompt now and then
            text = self.words(max(1, n // 2))
            n = self.text_len(text)
            if n >= L:
                return self.completion(stream)
            prompt: Any = text
        else:
            prompt = self.ids(n)
        body = self.sampling({"prompt": prompt, "max_tokens": self.max_tokens(L - n)})
        if stream:
            body["stream"] = True
            if r.random() < 0.7:
                body["stream_options"] = {"include_usage": True}
        return Req("stream" if stream else "completion", "/v1/completions", body, n)

    def chat(self, stream: bool) -> Req:
        L, r = self.w.max_seq_len, self.rng
        for _ in range(20):
            msgs = self.messages(r.randint(1, int(L * 0.6)))
            n = self.chat_len(msgs)
            if n < L:
                break
        else:
            raise RuntimeError("could not draw a chat prompt under the context limit")
        body = self.sampling({"messages": msgs, "max_tokens": self.max_tokens(L - n)})
        if stream:
            body["stream"] = True
            if r.random() < 0.7:
                body["stream_options"] = {"include_usage": True}
        return Req("stream_chat" if stream else "chat", "/v1/chat/completions", body, n)

    def at_limit(self) -> Req:
        """Prompt + max_tokens exactly the context limit (often a prompt of L - 1 tokens)."""
        L, r = self.w.max_seq_len, self.rng
        if r.random() < 0.3:
            msgs = self.messages(int(L * 0.6))
            n = self.chat_len(msgs)
            while n >= L:
                msgs[-1]["content"] = msgs[-1]["content"][: len(msgs[-1]["content"]) // 2]
                n = self.chat_len(msgs)
            k = L - n
            if k > self.w.long_tokens:
                k = 0
            if k:
                body = self.sampling({"messages": msgs, "max_tokens": k,
                                      "stream": r.random() < 0.5})
                return Req("at_limit_chat", "/v1/chat/completions", body, n)
        k = 1 if r.random() < 0.5 else r.randint(2, 8)
        n = L - k
        body = self.sampling({"prompt": self.ids(n), "max_tokens": k, "stream": r.random() < 0.5})
        body.pop("stop", None)
        return Req("at_limit", "/v1/completions", body, n)

    def over_limit(self) -> Req:
        """A request the server must refuse with 400 context_length_exceeded."""
        L, r = self.w.max_seq_len, self.rng
        choice = r.randrange(4)
        if choice == 0:  # a prompt of exactly the limit: no room for one token
            n, body = L, {"prompt": self.ids(L), "max_tokens": 1}
        elif choice == 1:  # a prompt over the limit
            n = L + r.randint(1, 64)
            body = {"prompt": self.ids(n), "max_tokens": 1}
        elif choice == 2:  # prompt fits, prompt + max_tokens does not
            k = r.randint(1, 16)
            n = L - k
            body = {"prompt": self.ids(n), "max_tokens": k + r.randint(1, 16)}
        else:  # a chat conversation longer than the limit
            msgs = self.messages(L)
            n = self.chat_len(msgs)
            while n < L:
                msgs[-1]["content"] += " " + self.words(L // 2)
                n = self.chat_len(msgs)
            body = {"messages": msgs, "max_tokens": 4}
        body = self.sampling(body)
        body.pop("stop", None)
        body["stream"] = r.random() < 0.3
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return Req("over_limit", path, body, n, expect="400")

    def long_stream(self) -> Req:
        """A long stream (chat or completion) for the cancel and reset actions."""
        L, r = self.w.max_seq_len, self.rng
        room = min(self.w.long_tokens, L // 2)
        n = r.randint(1, L - room)
        if r.random() < 0.5:
            body = self.sampling({"prompt": self.ids(n), "max_tokens": room, "stream": True})
            path = "/v1/completions"
        else:
            msgs = self.messages(r.randint(1, max(1, (L - room) // 3)))
            n = self.chat_len(msgs)
            body = self.sampling({"messages": msgs, "max_tokens": room, "stream": True})
            path = "/v1/chat/completions"
        body["ignore_eos"] = True
        body.pop("stop", None)
        return Req("long_stream", path, body, n)

    def next(self) -> Req:
        """One request of the steady mix."""
        r = self.rng
        x = r.random()
        if x < 0.18:
            return self.completion(stream=False)
        if x < 0.34:
            return self.completion(stream=True)
        if x < 0.45:
            return self.chat(stream=False)
        if x < 0.56:
            return self.chat(stream=True)
        if x < 0.65:
            return self.at_limit()
        if x < 0.74:  # instant 400s: cheap, so frequent
            return self.over_limit()
        if x < 0.83:  # a cancel: the client closes the stream after a few chunks
            req = self.long_stream()
            req.kind, req.action, req.k = "cancel", "cancel", r.randint(1, 6)
            return req
        if x < 0.91:  # a reset: the client's TCP connection dies mid-stream (RST)
            req = self.long_stream()
            req.kind, req.action, req.k = "reset", "rst", r.randint(0, 6)
            return req
        # a client that gives up waiting for a non-streamed answer
        req = self.long_stream()
        req.body["stream"] = False
        req.body.pop("stream_options", None)
        req.kind, req.action, req.t = "abort", "abort", round(r.uniform(0.2, 4.0), 2)
        return req

    def burst_request(self) -> Req:
        r = self.rng
        req = self.completion(stream=r.random() < 0.5, n=r.randint(1, 64))
        req.body["max_tokens"] = r.randint(1, 8)
        req.kind = "burst_" + req.kind
        return req


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
