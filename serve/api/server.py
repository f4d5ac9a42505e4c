"""Rank 0's HTTP server: aiohttp on its own thread and event loop.

The engine loop owns the main thread; this thread only parses, validates, moves events
and writes bytes, so /health/live stays fast while the engine is saturated. The socket
is bound in `start_http_server` before it returns, so a taken port fails the launch at
once with a message naming the port, and the server is live before any gate runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from serve.api.generate import dumps, handle_chat, handle_completions
from serve.api.guard import ClientErrorLog, ConnectionGuard, check_api_key
from serve.api.openapi import openapi_spec
from serve.api.protocol import ApiError
from serve.api.responses import handle_responses
from serve.api.state import STATE_KEY, TASKS_KEY, ServerState
from serve.api.tokenize import handle_detokenize, handle_tokenize
from serve.gcpolicy import PAUSES

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GUARD_KEY: web.AppKey[ConnectionGuard] = web.AppKey("llmserve_guard", ConnectionGuard)


class HttpBindError(OSError):
    """The HTTP socket could not be bound (port taken, no permission, bad host)."""


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    text = json.dumps(body, ensure_ascii=False, default=str)  # gates may hold paths etc.
    return web.Response(text=text, status=status, content_type="application/json",
                        headers=headers)


def error_response(exc: ApiError) -> web.Response:
    return web.Response(text=dumps(exc.body()), status=exc.status,
                        content_type="application/json", headers=exc.headers)


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> ApiError:
    """The router's 404/405 (and any other aiohttp HTTP error) in the OpenAI shape."""
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return ApiError(405, f"method {request.method} is not allowed on {request.path}; "
                        f"allowed: {allowed}", code="method_not_allowed",
                        headers={"Allow": allowed})
    if isinstance(exc, web.HTTPNotFound):
        return ApiError(404, f"no route {request.method} {request.path}", code="not_found")
    return ApiError(exc.status, exc.reason or "HTTP error", code=None)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    guard = request.app.get(GUARD_KEY)
    if guard is not None:
        guard.request_started(request)
    try:
        check_api_key(request)
        resp = await handler(request)
    except ApiError as exc:
        resp = error_response(exc)
    except web.HTTPException as exc:
        resp = error_response(_from_http_exception(request, exc))
    except ConnectionResetError:
        # The client went away mid-request. aiohttp would log this as a 500 with a
        # traceback; 499 (nginx's "client closed request") is what happened, and writing
        # it to the dead connection fails quietly.
        resp = web.Response(status=499)
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        resp = error_response(ApiError(500, "internal server error; see the server log",
                                       code="internal_error"))
    state.metrics.http_requests.labels(route=route, status=str(resp.status)).inc()
    return resp


async def _live(request: web.Request) -> web.Response:
    """200 while the process can serve or is getting there; 503 once it has failed (the
    job is exiting), so a liveness probe restarts it even if the exit were to hang."""
    readiness = request.app[STATE_KEY].readiness
    if readiness.phase == "failed":
        return json_response({"status": "failed", "reason": readiness.reason}, status=503)
    return json_response({"status": "live"})


def _gates(state: ServerState) -> list[dict[str, Any]]:
    try:
        return list(state.gates())
    except Exception:
        log.exception("gates() failed")
        return []


async def _ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    phase = state.readiness.phase
    body: dict[str, Any] = {"status": phase, "gates": _gates(state)}
    if state.readiness.reason:
        body["reason"] = state.readiness.reason
    ready = phase == "ready"
    return json_response(body, status=200 if ready else 503,
                         headers=None if ready else {"Retry-After": "5"})


async def _engine(request: web.Request) -> web.Response:
    return json_response(request.app[STATE_KEY].engine_report())


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "llmserve", "max_model_len": state.max_seq_len}


async def _models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request.app[STATE_KEY])]})


async def _model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    name = request.match_info["model"]
    if name != state.model_name:
        raise ApiError(404, f"the model '{name}' does not exist", type="invalid_request_error",
                       param="model", code="model_not_found")
    return json_response(_model_card(state))


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    executor = state.executor
    stats = None
    if executor is not None:
        try:
            stats = executor.stats()
        except Exception:  # a scrape must not fail because the engine is unhappy
            log.exception("executor.stats() failed during a metrics scrape")
    state.metrics.refresh(stats, _gates(state))
    state.metrics.refresh_gc(PAUSES.totals())
    state.metrics.refresh_grammar(state.grammar_stats())
    # generate_latest writes text format 0.0.4 (our names need no escaping); say so rather
    # than CONTENT_TYPE_LATEST, which is version=1.0.0 from prometheus_client 0.23 on.
    return web.Response(body=generate_latest(state.metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


def build_app(state: ServerState) -> web.Application:
    # client_max_size is aiohttp's own limit for request.read(); we read with our own
    # bounded reader (413 in the OpenAI shape), so only keep it out of the way.
    app = web.Application(middlewares=[_errors], client_max_size=state.max_body_bytes + 1)
    app[STATE_KEY] = state
    app[TASKS_KEY] = set()
    app.router.add_get("/health/live", _live)
    app.router.add_get("/health/ready", _ready)
    app.router.add_get("/v1/engine", _engine)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/v1/responses", handle_responses)
    app.router.add_post("/tokenize", handle_tokenize)
    app.router.add_post("/detokenize", handle_detokenize)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    return app


async def _openapi(request: web.Request) -> web.Response:
    return json_response(openapi_spec(request.app[STATE_KEY]))


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise HttpBindError(errno.EINVAL, f"cannot start the HTTP server: host {host!r} "
                            f"does not resolve ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # REUSEADDR lets a restarted worker rebind past TIME_WAIT; it does not allow two
        # listeners on one port, so a live server still makes this fail.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            msg = (f"cannot start the HTTP server: port {port} on {host} is already in use "
                   "(is another server running? pick another port)")
        else:
            msg = f"cannot bind the HTTP server to {host}:{port}: {exc.strerror or exc}"
        raise HttpBindError(exc.errno or errno.EINVAL, msg) from None
    return sock


class HttpServerHandle:
    """A running server thread. `port` is the bound port (the real one when 0 was asked)."""

    def __init__(self, state: ServerState, sock: socket.socket) -> None:
        self.state = state
        self.guard = ConnectionGuard(state.max_connections, state.header_timeout)
        self.app = build_app(state)
        self.app[GUARD_KEY] = self.guard
        self._sock = sock
        address = sock.getsockname()
        self.host: str = address[0]
        self.port: int = address[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="llmserve-http", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._sock.close()
            raise RuntimeError(f"HTTP server failed to start: {self._error}") from self._error

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            # handler_cancellation: a client that disconnects cancels its handler, whose
            # `finally` then cancels the request in the executor.
            state = self.state
            runner = web.AppRunner(self.app, handle_signals=False, access_log=None,
                                   handler_cancellation=True, shutdown_timeout=1.0,
                                   keepalive_timeout=state.keepalive_timeout,
                                   logger=ClientErrorLog(logging.getLogger("aiohttp.server")))
            loop.run_until_complete(runner.setup())
            assert runner.server is not None
            self.guard.attach(runner.server)
            loop.run_until_complete(web.SockSite(runner, self._sock).start())
            self._runner = runner
        except BaseException as exc:
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    async def _shutdown(self) -> None:
        tasks = list(self.app[TASKS_KEY])
        for task in tasks:  # each cancels its executor request on the way out
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the socket, cancel what is still running, and join the thread."""
        loop = self._loop
        if loop is None or not self._thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            log.warning("HTTP server did not shut down within %.1f s", timeout)
        except Exception:
            log.exception("error while shutting down the HTTP server")
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout)


def start_http_server(state: ServerState, host: str = "127.0.0.1", port: int = 8000, *,
                      backlog: int = 1024) -> HttpServerHandle:
    """Bind host:port (raises HttpBindError, an OSError, naming the port), start serving on
    a daemon thread, and return once requests are being accepted."""
    handle = HttpServerHandle(state, _bind(host, port, backlog))
    handle._start()
    return handle
