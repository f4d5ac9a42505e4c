"""The HTTP layer over real HTTP on 127.0.0.1: health/readiness, errors, metrics.

No executor here (the house rule forbids faking our own engine); generation end to end
is tested with the real torch executor elsewhere. Everything up to admission is real.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from serve.api import HttpBindError, HttpServerHandle, ServerState, start_http_server
from tests.unit.test_detok import build_tiny_tokenizer
from tests.unit.test_metrics import parse as parse_metrics

GATES = [
    {"name": "resolve", "state": "passed", "start": 1.0, "end": 1.5, "seconds": 0.5,
     "evidence": {"manifest": "ok"}, "reason": None},
    {"name": "load", "state": "running", "start": 1.5, "end": None, "seconds": None,
     "evidence": {}, "reason": None},
]


def call(port: int, method: str, path: str, body: bytes | str | dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    if isinstance(body, dict):
        body = json.dumps(body)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def assert_openai_error(status: int, raw: bytes, expected: int, etype: str | None = None
                        ) -> dict[str, Any]:
    assert status == expected, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if etype is not None:
        assert err["type"] == etype
    return err


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def server(tokenizer) -> Iterator[tuple[ServerState, HttpServerHandle]]:
    state = ServerState(model_name="tiny", tokenizer=tokenizer, max_seq_len=64, max_queue=4,
                        gates=lambda: GATES, engine_report=lambda: {"engine_id": "abc123"},
                        max_body_bytes=4096)
    handle = start_http_server(state, "127.0.0.1", 0)
    yield state, handle
    handle.stop(5)


def test_binds_before_return_and_reports_the_real_port(server) -> None:
    _, handle = server
    assert handle.port > 0 and handle.alive
    status, _, body = call(handle.port, "GET", "/health/live")
    assert status == 200 and json.loads(body) == {"status": "live"}


def test_port_in_use_raises_a_clear_oserror(server) -> None:
    state, handle = server
    with pytest.raises(HttpBindError, match=f"port {handle.port} .*already in use") as info:
        start_http_server(state, "127.0.0.1", handle.port)
    assert isinstance(info.value, OSError)
    assert call(handle.port, "GET", "/health/live")[0] == 200  # the first one is unharmed


def test_readiness_follows_the_phases(server) -> None:
    state, handle = server
    status, headers, body = call(handle.port, "GET", "/health/ready")
    assert status == 503 and "Retry-After" in headers
    assert json.loads(body) == {"status": "starting", "gates": GATES}
    state.readiness.set("ready")
    status, _, body = call(handle.port, "GET", "/health/ready")
    assert status == 200 and json.loads(body)["status"] == "ready"
    state.begin_drain()
    status, _, body = call(handle.port, "GET", "/health/ready")
    assert status == 503 and json.loads(body)["status"] == "draining"
    assert call(handle.port, "GET", "/health/live")[0] == 200  # live while draining
    state.readiness.set("failed", reason="gate load: shard hash mismatch")
    status, _, body = call(handle.port, "GET", "/health/ready")
    assert status == 503 and json.loads(body)["reason"] == "gate load: shard hash mismatch"
    # Failed is the one phase that is not live: the process is on its way out.
    status, _, body = call(handle.port, "GET", "/health/live")
    assert status == 503 and json.loads(body) == {"status": "failed",
                                                  "reason": "gate load: shard hash mismatch"}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": "tiny", "prompt": "the lazy dog", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
@pytest.mark.parametrize(("phase", "code"), [("starting", "server_starting"),
                                             ("draining", "server_draining"),
                                             ("ready", "server_ready")])
def test_valid_generation_requests_get_503_without_admission(server, path, body, phase,
                                                             code) -> None:
    state, handle = server
    state.readiness.set(phase)  # "ready" without an executor must still refuse safely
    status, headers, raw = call(handle.port, "POST", path, body)
    err = assert_openai_error(status, raw, 503, "service_unavailable_error")
    assert err["code"] == code and int(headers["Retry-After"]) >= 1
    assert state.in_flight() == 0


def test_unknown_route_and_unknown_model_are_404(server) -> None:
    _, handle = server
    status, _, raw = call(handle.port, "GET", "/v2/nothing")
    assert_openai_error(status, raw, 404, "not_found_error")
    status, _, raw = call(handle.port, "POST", "/v1/completions",
                          {"model": "gpt-4", "prompt": "hi"})
    err = assert_openai_error(status, raw, 404)
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]
    status, _, raw = call(handle.port, "GET", "/v1/models/gpt-4")
    assert_openai_error(status, raw, 404)


def test_wrong_method_is_405_with_allow(server) -> None:
    _, handle = server
    status, headers, raw = call(handle.port, "GET", "/v1/completions")
    assert_openai_error(status, raw, 405)
    assert headers["Allow"] == "POST"
    status, _, raw = call(handle.port, "DELETE", "/health/live")
    assert_openai_error(status, raw, 405)


def test_oversized_bodies_are_413_declared_or_chunked(server) -> None:
    _, handle = server
    big = json.dumps({"prompt": "x" * 5000})
    status, _, raw = call(handle.port, "POST", "/v1/completions", big)
    assert_openai_error(status, raw, 413)
    # No Content-Length: the bounded reader must stop it while streaming.
    conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=10)
    conn.request("POST", "/v1/completions", body=iter([big[:3000].encode(), big[3000:].encode()]),
                 encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert_openai_error(resp.status, resp.read(), 413)
    conn.close()


@pytest.mark.parametrize(("body", "param"), [
    (b"{oops", None),
    (b"[]", None),
    (json.dumps({"prompt": "hi", "max_tokens": "many"}), "max_tokens"),
    (json.dumps({"prompt": "hi", "n": 0}), "n"),
    (json.dumps({"prompt": "hi", "response_format": {"type": "json_schema",
                                                     "json_schema": {"schema": {"type": 5}}}}),
     "response_format"),
    (json.dumps({"prompt": "hi", "logit_bias": {"99999": 1}}), "logit_bias"),
    (json.dumps({"prompt": "the lazy dog", "max_tokens": 64}), "max_tokens"),
    (json.dumps({"prompt": [1, 99999]}), "prompt"),
])
def test_bad_requests_are_400_even_before_admission(server, body, param) -> None:
    _, handle = server
    status, _, raw = call(handle.port, "POST", "/v1/completions", body,
                          {"Content-Type": "application/json"})
    err = assert_openai_error(status, raw, 400, "invalid_request_error")
    assert err["param"] == param


def test_context_length_error_over_http_names_both_numbers(server, tokenizer) -> None:
    _, handle = server
    n_prompt = len(tokenizer("the lazy dog")["input_ids"])
    status, _, raw = call(handle.port, "POST", "/v1/completions",
                          {"prompt": "the lazy dog", "max_tokens": 64})
    err = assert_openai_error(status, raw, 400)
    assert f"({n_prompt})" in err["message"] and "64" in err["message"]


def test_models_and_engine_report(server) -> None:
    _, handle = server
    status, _, raw = call(handle.port, "GET", "/v1/models")
    body = json.loads(raw)
    assert status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [("tiny", "model")]
    status, _, raw = call(handle.port, "GET", "/v1/engine")
    assert status == 200 and json.loads(raw) == {"engine_id": "abc123"}


def test_handler_exception_is_a_500_json_and_server_keeps_serving(server) -> None:
    state, handle = server

    def broken() -> dict[str, Any]:
        raise KeyError("secret internal detail")

    state.engine_report = broken
    status, _, raw = call(handle.port, "GET", "/v1/engine")
    err = assert_openai_error(status, raw, 500, "server_error")
    assert "secret" not in err["message"] and "Traceback" not in raw.decode()
    assert call(handle.port, "GET", "/health/live")[0] == 200


def test_metrics_exposition_counts_responses_and_gate_seconds(server) -> None:
    _, handle = server
    call(handle.port, "GET", "/nope")
    call(handle.port, "GET", "/health/live")
    status, headers, raw = call(handle.port, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    page = parse_metrics(raw.decode())
    assert page.types["llmserve_time_to_first_token_seconds"] == "histogram"
    assert page.value("llmserve_startup_gate_seconds", gate="resolve") == 0.5
    assert page.value("llmserve_http_requests_total", route="unmatched", status="404") == 1
    assert page.value("llmserve_http_requests_total", route="/health/live", status="200") == 1


def test_a_stalled_client_does_not_block_others(server) -> None:
    state, handle = server
    stalled = socket.create_connection(("127.0.0.1", handle.port))
    try:  # headers promise 100 bytes, only 5 arrive: its handler waits on the body
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 100\r\n\r\n{\"pro")
        for _ in range(3):
            t0 = time.perf_counter()
            assert call(handle.port, "GET", "/health/live")[0] == 200
            assert time.perf_counter() - t0 < 1.0
    finally:
        stalled.close()
    # Its handler ends as "client closed request" (499), not a 500 with a traceback.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        _, _, raw = call(handle.port, "GET", "/metrics")
        if 'route="/v1/completions",status="499"} 1.0' in raw.decode():
            break
        time.sleep(0.02)
    else:
        pytest.fail("the stalled request was not closed as 499")
    assert state.in_flight() == 0


def test_live_answers_fast_while_another_thread_computes(server) -> None:
    _, handle = server
    stop = threading.Event()

    def busy() -> None:  # stands in for the engine loop holding the GIL on the main thread
        x = 0
        while not stop.is_set():
            for i in range(10000):
                x += i * i

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        latencies = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert call(handle.port, "GET", "/health/live")[0] == 200
            latencies.append(time.perf_counter() - t0)
    finally:
        stop.set()
        worker.join()
    assert statistics.median(latencies) < 0.1, latencies
    assert max(latencies) < 0.5, latencies


def test_stop_releases_the_port(tokenizer) -> None:
    state = ServerState(model_name="tiny", tokenizer=tokenizer, max_seq_len=64)
    handle = start_http_server(state, "127.0.0.1", 0)
    port = handle.port
    assert call(port, "GET", "/health/live")[0] == 200
    handle.stop(5)
    assert not handle.alive
    with pytest.raises(OSError):
        call(port, "GET", "/health/live")
    start_http_server(state, "127.0.0.1", port).stop(5)  # rebinding works right away
