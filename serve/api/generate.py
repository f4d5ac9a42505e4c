"""POST /v1/completions and /v1/chat/completions: validate, submit, stream back.

Order of checks: body size (413) -> JSON and parameters (400) -> model (404) -> a batch
larger than the queue (400) -> tokenize, context length and structured-output grammar
(400; a grammar that does not compile within the deadline too) -> admission (503) ->
queue depth (429) -> submit (400 for a field the engine cannot honour). Invalid requests
get their 400 even while the worker is starting or draining: retrying them later would
not help, and a 429 is only for load that clears.
The request in flight, its choices and events are in run.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from runtime.core.grammar import Grammar, GrammarError
from runtime.core.types import Executor, SamplingParams, UnsupportedParameter
from serve.api.prompt import build_sampling_params, encode_prompts, model_vocab
from serve.api.protocol import (
    ApiError,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from serve.api.run import Run
from serve.api.state import STATE_KEY, TASKS_KEY, ServerState
from serve.api.tools import prepare as prepare_tools

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


# A parsed request's answer: JSON or a stream, from the Run once submitted.
Respond = Callable[[web.Request, Run], Awaitable[web.StreamResponse]]
Parse = Callable[[dict[str, Any]], GenerationRequest]


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await serve_generation(request, parse_completion_request)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await serve_generation(request, parse_chat_request)


async def serve_generation(request: web.Request, parse: Parse,
                           respond: Respond | None = None) -> web.StreamResponse:
    """Parse the body into a request, run it, and answer with `respond` (default: the
    completion or chat JSON, or its chunks with stream: true). Other APIs (responses.py)
    translate their body to a chat request in `parse` and their answer in `respond`."""
    state = request.app[STATE_KEY]
    tasks = request.app[TASKS_KEY]
    task = asyncio.current_task()
    state._enter()
    if task is not None:
        tasks.add(task)
    try:
        return await _generate(request, state, parse, respond, time.perf_counter())
    finally:
        if task is not None:
            tasks.discard(task)
        state._leave()


def _prepare(state: ServerState, req: GenerationRequest
             ) -> tuple[list[list[int]], SamplingParams]:
    """Tokenize, check lengths and ids (worker thread: it can take long enough to stall
    every other connection if run on the event loop)."""
    tokenizer = state.tokenizer
    prompts = encode_prompts(req, tokenizer, state.vocab_size)
    vocab = model_vocab(tokenizer, state.vocab_size)
    params = [build_sampling_params(req, len(ids), state.max_seq_len, state.eos_token_ids(),
                                    vocab) for ids in prompts]
    # The budget is the same for every prompt but for a chat default (one prompt only).
    return prompts, min(params, key=lambda p: p.max_tokens)


def _retrieved(future: asyncio.Future[Any]) -> None:
    # An abandoned compile's outcome is nobody's: mark it seen, so asyncio does not log
    # "exception was never retrieved" for a schema that failed after its deadline.
    if not future.cancelled():
        future.exception()


async def _compile_grammar(state: ServerState, req: GenerationRequest) -> Grammar:
    """The request's grammar, compiled on the compiler's bounded pool. The wait has a
    deadline (compiles have no bound: seconds to minutes for a large schema); past it the
    request is a 400 naming the field, and the compile runs on into the cache."""
    assert req.guided is not None
    param = req.guided_param or "response_format"
    compiler = state.grammar_compiler()
    timeout = compiler.config.compile_timeout_s
    future = compiler.start(req.guided)
    try:
        waiting = asyncio.wrap_future(future)
        waiting.add_done_callback(_retrieved)
        # asyncio.wait, not wait_for: a timeout must not cancel a compile others may share.
        await asyncio.wait([waiting], timeout=timeout)
        if not waiting.done():
            state.metrics.grammar_compile_timeouts.inc()
            raise ApiError(400, f"'{param}' did not compile to a grammar within {timeout:g} s "
                           "(the server's --grammar-compile-timeout); simplify the schema",
                           param=param, code="grammar_compile_timeout")
        return waiting.result()
    except GrammarError as exc:
        raise ApiError(400, f"'{param}' does not compile to a grammar: {exc}",
                       param=param, code="invalid_value") from None
    finally:
        compiler.release(req.guided, future)


# SamplingParams fields an executor may refuse -> the request field the client sent.
_PARAM_NAMES = {"prompt_logprobs": "echo", "guided": "response_format",
                "num_sequences": "n"}


async def _generate(request: web.Request, state: ServerState, parse: Parse,
                    respond: Respond | None, arrival: float) -> web.StreamResponse:
    req = parse(parse_json_body(await read_body(request, state.max_body_bytes)))
    if req.model is not None and req.model != state.model_name:
        raise ApiError(404, f"the model '{req.model}' does not exist; this server serves "
                       f"'{state.model_name}'", type="invalid_request_error", param="model",
                       code="model_not_found")
    if len(req.prompts) > state.max_queue:
        # Never admissible, however long the client waits: a 400, not a 429 to retry.
        raise ApiError(400, f"'prompt' holds {len(req.prompts)} prompts but this server "
                       f"admits at most {state.max_queue} requests at once (--max-queue); "
                       f"send at most {state.max_queue} prompts per request", param="prompt",
                       code="batch_exceeds_max_queue")
    if state.tokenizer is None:
        raise unavailable(state)
    if req.tools is not None:  # the tool format, its prompt and grammar (xgrammar: off-loop)
        # An executor without grammars (trtllm's guided_decoding False) leaves auto free.
        req = await asyncio.get_running_loop().run_in_executor(
            None, prepare_tools, req, getattr(state.tokenizer, "chat_template", None),
            state.tool_parser, getattr(state.executor, "guided_decoding", True))
    prompts, params = await asyncio.get_running_loop().run_in_executor(
        None, _prepare, state, req)
    if req.guided is not None:
        params = replace(params, grammar=await _compile_grammar(state, req))
    executor = state.executor
    if not state.readiness.is_ready or executor is None:
        raise unavailable(state)
    queued = executor.num_unfinished()
    if queued + len(prompts) > state.max_queue:
        raise ApiError(429, f"the server is at capacity ({queued} requests queued or "
                       f"running, limit {state.max_queue}); retry later",
                       code="queue_full", headers={"Retry-After": "1"})
    run = Run(state, req, prompts, params, arrival, state.token_texts())
    try:
        for p, sub in enumerate(run.subs):
            try:
                executor.add_request(sub.request_id, sub.prompt_ids, params, run.callback(p))
            except UnsupportedParameter as exc:  # a 400 naming the field the client sent
                name = _PARAM_NAMES.get(exc.param, exc.param)
                if exc.param == "guided" and req.guided_param:  # tools, tool_choice, guided_*
                    name = req.guided_param
                if name == "logprobs" and req.kind == "chat":
                    name = "top_logprobs"
                if name == "n" and req.best_of is not None:
                    name = "best_of"
                raise ApiError(400, f"'{name}': {exc}", param=name,
                               code="unsupported_parameter") from None
            except ValueError as exc:
                raise ApiError(400, f"the engine rejected the request: {exc}") from None
            sub.live = params.num_sequences
        if respond is not None:
            return await respond(request, run)
        if req.stream:
            return await _stream(request, run)
        return await _complete(run)
    finally:
        # Stop string matched, client gone, error, or server stopping: free the slots.
        for sub in run.subs:
            if not sub.engine_done:
                _cancel(executor, sub.request_id)


def _cancel(executor: Executor, request_id: str) -> None:
    try:
        executor.cancel(request_id)
    except Exception:  # best effort: the request may have finished meanwhile
        log.exception("executor.cancel(%s) failed", request_id)


async def _next(run: Run) -> Any:
    """The next update; a sub whose choices all ended is cancelled at once (stop strings),
    so its sequences do not run on unseen."""
    sub, update = await run.next()
    if not sub.engine_done and all(c.finish is not None for c in sub.choices):
        executor = run.state.executor
        if executor is not None:
            _cancel(executor, sub.request_id)
            sub.live, sub.cancelled = 0, True
    return update


next_update = _next  # the same for other answer formats (responses.py)


async def _complete(run: Run) -> web.Response:
    while not run.done:
        await _next(run)
    body = run.envelope(chunk=False)
    body["choices"] = [run.final_choice(c) for c in run.best()]
    body["usage"] = run.usage()
    return web.Response(text=dumps(body), content_type="application/json",
                        headers={"X-Request-Id": run.request_id})


async def _stream(request: web.Request, run: Run) -> web.StreamResponse:
    # Headers go out with the first engine event, so a request the engine rejects at
    # admission still gets a plain HTTP error status rather than an in-band one.
    pending = await _next(run)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                       "X-Request-Id": run.request_id})
    await resp.prepare(request)
    include_usage = run.req.include_usage

    async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
        chunk = run.envelope(chunk=True)
        chunk["choices"] = choices
        if include_usage:  # OpenAI: usage is null on every chunk but the last
            chunk["usage"] = usage
        await resp.write(f"data: {dumps(chunk)}\n\n".encode())

    try:
        if run.req.kind == "chat":
            for c in run.choices:
                await send([run.stream_choice(c, "", None, first=True)])
        first = True
        while first or not run.done:
            try:
                update = pending if first else await _next(run)
                first = False
            except ApiError as exc:
                # Headers (200) are already out: report the error in-band, then end.
                await resp.write(f"data: {dumps(exc.body())}\n\n".encode())
                break
            if update is None:
                continue
            if update.finish is not None or update.text or _pending_logprobs(update.choice):
                # A last chunk without text carries no "content" in a chat delta.
                text = (update.text or None) if update.finish is not None else update.text
                await send([run.stream_choice(update.choice, text, update.finish)])
        else:
            if include_usage:
                await send([], run.usage())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away; the caller cancels the request in the executor
    return resp


def _pending_logprobs(choice: Any) -> bool:
    lps = choice.logprobs
    if lps is None:
        return False
    return bool(getattr(lps, "tokens", None) or getattr(lps, "content", None))
