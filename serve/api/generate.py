"""POST /v1/completions and /v1/chat/completions: validate, submit, stream back.

Order of checks: body size (413) -> JSON and parameters (400) -> model (404) -> tokenize
and context length (400) -> admission (503) -> queue depth (429) -> submit. Invalid
requests get their 400 even while the worker is starting or draining: retrying them later
would not help. Token events arrive on the engine thread and cross into this event loop
through `loop.call_soon_threadsafe` into a per-request asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from runtime.types import Executor, TokenEvent
from serve.api.detok import OutputText
from serve.api.prompt import build_sampling_params, encode_prompt
from serve.api.protocol import (
    ApiError,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from serve.api.state import STATE_KEY, TASKS_KEY, ServerState

log = logging.getLogger(__name__)
BODY_READ_TIMEOUT_S = 30.0
_RETRY_AFTER = {"starting": "5", "draining": "2", "failed": "30", "ready": "1"}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def read_body(request: web.Request, limit: int) -> bytes:
    """Read at most `limit` bytes; larger bodies (declared or streamed) are a 413."""
    too_big = ApiError(413, f"request body exceeds the limit of {limit} bytes",
                       code="request_too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_big

    async def _read() -> bytes:
        buf = bytearray()
        while chunk := await request.content.read(64 * 1024):
            buf += chunk
            if len(buf) > limit:
                raise too_big
        return bytes(buf)

    try:
        return await asyncio.wait_for(_read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {BODY_READ_TIMEOUT_S:.0f} s",
                       type="invalid_request_error", code="timeout") from None


def unavailable(state: ServerState) -> ApiError:
    phase = state.readiness.phase
    message = {"starting": "the server is starting and not ready yet; see /health/ready",
               "draining": "the server is draining and accepts no new requests",
               "failed": f"the server failed to start: {state.readiness.reason or 'unknown'}",
               "ready": "the engine is not attached yet"}[phase]
    return ApiError(503, message, code=f"server_{phase}",
                    headers={"Retry-After": _RETRY_AFTER[phase]})


class _Run:
    """One submitted request: its event queue, text state, counters and timings."""

    def __init__(self, state: ServerState, req: GenerationRequest, prompt_ids: list[int],
                 arrival: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.state, self.req, self.arrival = state, req, arrival
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.engine_done = False  # the executor sent its last event; nothing to cancel
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        eos = () if req.ignore_eos else state.eos_token_ids()
        self.output = OutputText(state.tokenizer, prompt_ids, req.stop, skip_token_ids=eos)
        self._last_token_at: float | None = None

    def on_event(self, event: TokenEvent) -> None:
        """Called on the engine thread: hand the event to the event loop, never block."""
        # RuntimeError: the loop is closed (server stopped); nobody waits for the event.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def _observe(self, n_tokens: int) -> None:
        now = time.perf_counter()
        metrics = self.state.metrics
        if self._last_token_at is None:
            metrics.ttft.observe(now - self.arrival)
            metrics.prompt_tokens.inc(self.prompt_tokens)  # the prompt has been processed
        else:
            # Tokens that arrive together share the gap (one histogram sample per token).
            gap = (now - self._last_token_at) / n_tokens
            for _ in range(n_tokens):
                metrics.itl.observe(gap)
        self._last_token_at = now
        self.completion_tokens += n_tokens
        metrics.generation_tokens.inc(n_tokens)

    async def next(self) -> tuple[str, str | None]:
        """Wait for the next engine event: (text delta, finish reason or None)."""
        event = await self.queue.get()
        if event.token_ids:
            self._observe(len(event.token_ids))
        if event.finish_reason is not None:
            self.engine_done = True
        delta = self.output.push(event.token_ids)
        if delta.stopped:
            return delta.text, self._finish("stop")
        if event.finish_reason in ("stop", "length"):
            tail = self.output.finish()
            return delta.text + tail.text, self._finish("stop" if tail.stopped else
                                                        event.finish_reason)
        if event.finish_reason == "cancelled":
            raise ApiError(503, "the request was cancelled by the server", code="cancelled")
        reason = event.error or "unknown error"
        if event.finish_reason == "rejected":
            # The engine refuses at admission what it can never serve (e.g. more KV
            # blocks than the cache has): the client can fix that, so it is a 400.
            raise ApiError(400, f"the engine rejected the request: {reason}",
                           code="engine_rejected")
        if event.finish_reason == "error":
            raise ApiError(500, f"generation failed: {reason}", code="generation_error")
        return delta.text, None

    def _finish(self, reason: str) -> str:
        metrics = self.state.metrics
        metrics.e2e.observe(time.perf_counter() - self.arrival)
        metrics.request_success.labels(finished_reason=reason).inc()
        return reason

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def envelope(self, chunk: bool) -> dict[str, Any]:
        chat = self.req.kind == "chat"
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat \
            else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.state.model_name}

    def choice(self, text: str | None, finish: str | None, first: bool = False
               ) -> dict[str, Any]:
        """A streamed choice (text None: no content in this chunk)."""
        if self.req.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    tasks = request.app[TASKS_KEY]
    task = asyncio.current_task()
    state._enter()
    if task is not None:
        tasks.add(task)
    try:
        return await _generate(request, state, kind, time.perf_counter())
    finally:
        if task is not None:
            tasks.discard(task)
        state._leave()


async def _generate(request: web.Request, state: ServerState, kind: str,
                    arrival: float) -> web.StreamResponse:
    body = parse_json_body(await read_body(request, state.max_body_bytes))
    req = parse_chat_request(body) if kind == "chat" else parse_completion_request(body)
    if req.model is not None and req.model != state.model_name:
        raise ApiError(404, f"the model '{req.model}' does not exist; this server serves "
                       f"'{state.model_name}'", type="invalid_request_error", param="model",
                       code="model_not_found")
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise unavailable(state)
    prompt_ids = await asyncio.get_running_loop().run_in_executor(
        None, encode_prompt, req, tokenizer, state.vocab_size)
    params = build_sampling_params(req, len(prompt_ids), state.max_seq_len,
                                   state.eos_token_ids())
    executor = state.executor
    if not state.readiness.is_ready or executor is None:
        raise unavailable(state)
    queued = executor.num_unfinished()
    if queued >= state.max_queue:
        raise ApiError(429, f"the server is at capacity ({queued} requests queued or "
                       f"running, limit {state.max_queue}); retry later",
                       code="queue_full", headers={"Retry-After": "1"})
    run = _Run(state, req, prompt_ids, arrival)
    try:
        executor.add_request(run.request_id, prompt_ids, params, run.on_event)
    except ValueError as exc:
        raise ApiError(400, f"the engine rejected the request: {exc}") from None
    try:
        if req.stream:
            return await _stream(request, run)
        return await _complete(run)
    finally:
        # Stop string matched, client gone, error, or server stopping: free the slot.
        if not run.engine_done:
            _cancel(executor, run.request_id)


def _cancel(executor: Executor, request_id: str) -> None:
    try:
        executor.cancel(request_id)
    except Exception:  # best effort: the request may have finished meanwhile
        log.exception("executor.cancel(%s) failed", request_id)


async def _complete(run: _Run) -> web.Response:
    parts: list[str] = []
    while True:
        text, finish = await run.next()
        parts.append(text)
        if finish is not None:
            break
    body = run.envelope(chunk=False)
    text = "".join(parts)
    if run.req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    body["choices"] = [choice]
    body["usage"] = run.usage()
    return web.Response(text=dumps(body), content_type="application/json",
                        headers={"X-Request-Id": run.request_id})


async def _stream(request: web.Request, run: _Run) -> web.StreamResponse:
    # Headers go out with the first engine event, so a request the engine rejects at
    # admission still gets a plain HTTP error status rather than an in-band one.
    pending: tuple[str, str | None] | None = await run.next()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                       "X-Request-Id": run.request_id})
    await resp.prepare(request)
    include_usage = run.req.include_usage

    async def send(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> None:
        chunk = run.envelope(chunk=True)
        chunk["choices"] = choices
        if include_usage:  # OpenAI: usage is null on every chunk but the last
            chunk["usage"] = usage
        await resp.write(f"data: {dumps(chunk)}\n\n".encode())

    try:
        if run.req.kind == "chat":
            await send([run.choice("", None, first=True)])
        while True:
            try:
                text, finish = pending if pending is not None else await run.next()
                pending = None
            except ApiError as exc:
                # Headers (200) are already out: report the error in-band, then end.
                await resp.write(f"data: {dumps(exc.body())}\n\n".encode())
                break
            if finish is not None:
                await send([run.choice(text or None, finish)])
                if include_usage:
                    await send([], run.usage())
                break
            if text:
                await send([run.choice(text, None)])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away; the caller cancels the request in the executor
    return resp
