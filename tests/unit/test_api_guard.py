"""The HTTP surface's guards over real HTTP: API key, connection cap, header timeout,
the OpenAPI description."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest

from serve.api import HttpServerHandle, ServerState, start_http_server
from tests.unit.test_api_server import assert_openai_error, call
from tests.unit.test_detok import build_tiny_tokenizer

KEY = "s3cret-key"


@pytest.fixture
def guarded() -> Iterator[tuple[ServerState, HttpServerHandle]]:
    state = ServerState(model_name="tiny", tokenizer=build_tiny_tokenizer(), max_seq_len=64,
                        api_key=KEY, max_connections=4, header_timeout=0.5)
    handle = start_http_server(state, "127.0.0.1", 0)
    yield state, handle
    handle.stop(5)


@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", "Basic s3cret-key", "Bearer ",
                                  f"Bearer {KEY}x"])
def test_v1_needs_the_api_key(guarded, auth: str | None) -> None:
    _, handle = guarded
    headers = {} if auth is None else {"Authorization": auth}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("GET", "/v1/engine")):
        status, hdrs, raw = call(handle.port, method, path, {"prompt": "x"}, headers)
        err = assert_openai_error(status, raw, 401, "invalid_request_error")
        assert err["code"] == "invalid_api_key" and hdrs["WWW-Authenticate"] == "Bearer"


def test_the_right_key_passes_and_probes_stay_open(guarded) -> None:
    _, handle = guarded
    status, _, raw = call(handle.port, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "tiny"
    for path in ("/health/live", "/metrics", "/openapi.json"):
        assert call(handle.port, "GET", path)[0] == 200, path
    assert call(handle.port, "GET", "/health/ready")[0] == 503  # open, just not ready


def test_connections_over_the_cap_are_closed_at_accept(guarded) -> None:
    _state, handle = guarded
    held = [socket.create_connection(("127.0.0.1", handle.port)) for _ in range(4)]
    try:
        extra = socket.create_connection(("127.0.0.1", handle.port))
        extra.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            assert extra.recv(1) == b""  # closed without a byte
        extra.close()
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert call(handle.port, "GET", "/health/live")[0] == 200  # room again


def test_a_trickled_header_is_cut_off(guarded) -> None:
    _, handle = guarded
    slow = socket.create_connection(("127.0.0.1", handle.port))
    slow.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n")  # never finishes the header
    slow.settimeout(5)
    t0 = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        assert slow.recv(1) == b""
    assert time.monotonic() - t0 < 3
    slow.close()
    # A prompt client on a fresh connection is unaffected, and so is a kept-alive one.
    assert call(handle.port, "GET", "/health/live")[0] == 200


def test_openapi_describes_every_route_and_the_security(guarded) -> None:
    state, handle = guarded
    status, _, raw = call(handle.port, "GET", "/openapi.json")
    spec = json.loads(raw)
    assert status == 200 and spec["openapi"].startswith("3.")
    routes = {r.resource.canonical for r in handle.app.router.routes()}
    assert routes == set(spec["paths"]) | {"/openapi.json"}
    assert spec["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in spec["paths"]["/health/live"]["get"]
    state.api_key = None
    assert "securitySchemes" not in json.loads(call(handle.port, "GET", "/openapi.json")[2])[
        "components"]


def test_idle_keepalive_outlasts_the_clients_pools() -> None:
    """Whoever closes an idle connection first must be the client: a server that closes at
    the clients' own pool expiry races their reuse ("Server disconnected" for a request the
    server never read; seen once in a 30-minute soak with both at 15 s)."""
    import asyncio

    import aiohttp
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    async def aiohttp_expiry() -> float:
        connector = aiohttp.TCPConnector()
        try:
            return float(connector._keepalive_timeout)  # type: ignore[attr-defined]
        finally:
            await connector.close()

    ours = ServerState(model_name="tiny", tokenizer=build_tiny_tokenizer(),
                       max_seq_len=64).keepalive_timeout
    clients = {"aiohttp": asyncio.run(aiohttp_expiry()),
               "openai": float(DEFAULT_CONNECTION_LIMITS.keepalive_expiry or 0.0)}
    assert all(v > 0 for v in clients.values()), clients
    for name, expiry in clients.items():
        assert ours >= 2 * expiry, f"server keep-alive {ours} s vs {name}'s pool {expiry} s"


def test_an_idle_keepalive_connection_past_the_header_timeout_is_served(guarded) -> None:
    """The header timeout is for a connection's first request only: a pooled connection
    idle longer than it (0.5 s here) still carries the next request."""
    _, handle = guarded
    request = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n"
               ).encode()
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as s:
        for _ in range(2):
            s.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(65536)
                assert chunk, "the server closed a keep-alive connection"
                head += chunk
            assert head.startswith(b"HTTP/1.1 200")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += s.recv(65536)
            time.sleep(1.0)
