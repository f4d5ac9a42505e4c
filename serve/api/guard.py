"""What stands between the network and the handlers: the API key, and connection limits.

- `/v1/*` needs `Authorization: Bearer <key>` when the server has a key (as vLLM's and
  trtllm-serve's `--api-key`); probes (`/health/*`), `/metrics` and `/openapi.json` stay
  open. The key is compared in constant time.
- At most `max_connections` connections are open at once; one more is closed at accept.
- A connection must deliver a complete request header within `header_timeout` seconds
  of opening, or it is closed: a client that trickles its header (slowloris) holds
  nothing for long. aiohttp has no such timeout of its own.
- A request aiohttp's parser refuses (Content-Length beside Transfer-Encoding, a negative
  Content-Length) is the client's error: one INFO line, where aiohttp logs an ERROR with
  a traceback for each (anyone could fill the log with them).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from serve.api.protocol import ApiError
from serve.api.state import STATE_KEY

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = ("/health/", "/metrics", "/openapi.json")


def check_api_key(request: web.Request) -> None:
    """Raise a 401 unless the request carries the server's key (when it has one)."""
    key = request.app[STATE_KEY].api_key
    if key is None or request.path.startswith(OPEN_PATHS):
        return
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                       type="invalid_request_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


class ConnectionGuard:
    """Caps open connections and closes those whose first request header is late.

    Hooks the aiohttp Server's connection_made, which every new connection calls.
    """

    def __init__(self, max_connections: int, header_timeout: float) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.refused = 0
        self.timed_out = 0
        # Transports of connections that got past a request header (the handlers have
        # __slots__ and no weak references; asyncio's transports do).
        self._started: weakref.WeakSet[Any] = weakref.WeakSet()
        self._server: web.Server | None = None
        self._made: Callable[[Any, asyncio.Transport], None] | None = None

    def attach(self, server: web.Server) -> None:
        """Watch `server`'s connections (once the runner has made it)."""
        self._server, self._made = server, server.connection_made
        server.connection_made = self._connection_made  # type: ignore[method-assign]

    def request_started(self, request: web.Request) -> None:
        if request.transport is not None:
            self._started.add(request.transport)

    def _connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        assert self._server is not None and self._made is not None
        self._made(handler, transport)
        if len(self._server.connections) > self.max_connections:
            self.refused += 1
            log.warning("refused a connection: %d open (limit %d)",
                        len(self._server.connections) - 1, self.max_connections)
            transport.close()
            return
        asyncio.get_running_loop().call_later(self.header_timeout, self._check, handler,
                                              transport)

    def _check(self, handler: Any, transport: asyncio.Transport) -> None:
        if transport not in self._started and not transport.is_closing():
            self.timed_out += 1
            transport.close()


class ClientErrorLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger (AppRunner(logger=...)), with the client's parse errors
    (HTTP 4xx) logged in one INFO line without a traceback; the rest as aiohttp logs it."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError) and 400 <= exc_info.code < 500:
            # aiohttp's message spans lines (the header, a caret under the bad byte).
            detail = " ".join(str(exc_info.message).split()).removesuffix(" ^")
            self.logger.info("%s: %d %s", msg % args if args else msg, exc_info.code, detail)
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)
