"""Issue 37's hostile inputs against a served TP=2 engine, over real HTTP on loopback.

One server of its own, with a small queue and a short grammar deadline:
- a lone surrogate in a prompt or message is a 400 naming the field (it was a 500);
- a completions batch larger than --max-queue is a 400 (it was a 429 forever);
- the red-team schema is a 400 within the deadline (it compiled for 131.9 s), and its
  compile finishes into the cache, counted in /metrics;
- requests aiohttp's parser refuses leave no traceback in the log.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, given, settings

from tests.e2e.conftest import MODEL
from tests.e2e.harness import HOST, Server, launch
from tests.unit.test_api_hostile import TEXT
from tests.unit.test_grammar import big_schema
from tests.unit.test_metrics import parse as parse_metrics

MAX_QUEUE = 16
DEADLINE = 1.0  # --grammar-compile-timeout; the big schema takes ~3 s on the tiny vocabulary
C, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def hostile(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch(engine_dir, tmp_path_factory.mktemp("hostile"),
                 args=("--max-queue", str(MAX_QUEUE), "--grammar-compile-timeout",
                       str(DEADLINE)))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


def _metric(srv: Server, name: str) -> float:
    return parse_metrics(srv.metrics()).value(name)


def test_lone_surrogates_are_400s_naming_the_field(hostile: Server) -> None:
    # Raw requests: the openai client cannot encode a lone surrogate; json.dumps writes it
    # as the \ud800 escape, as the red team's client did.
    for path, body, param, where in [
            (C, {"model": MODEL, "prompt": "hi \ud800", "max_tokens": 2}, "prompt", "'prompt'"),
            (C, {"model": MODEL, "prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt",
             "'prompt[1]'"),
            (CHAT, {"model": MODEL, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi \ud800"}]}, "messages",
             "'messages[0].content'")]:
        reply = hostile.call("POST", path, json.dumps(body))
        assert reply.status == 400, reply
        err = reply.json()["error"]
        assert (err["param"], err["code"], err["type"]) == (param, "invalid_text",
                                                           "invalid_request_error"), err
        assert where in err["message"], err


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prompt=TEXT, content=TEXT)
def test_no_prompt_or_message_text_gets_a_5xx(hostile: Server, prompt: str,
                                              content: str) -> None:
    for path, body in ((C, {"model": MODEL, "prompt": prompt, "max_tokens": 1}),
                       (CHAT, {"model": MODEL, "max_tokens": 1,
                               "messages": [{"role": "user", "content": content}]})):
        reply = hostile.call("POST", path, json.dumps(body))
        assert reply.status < 500, (body, reply)
        if reply.status != 200:
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_a_batch_larger_than_the_queue_is_a_400_and_a_full_one_is_served(
        hostile: Server) -> None:
    client = hostile.client()
    with pytest.raises(openai.BadRequestError) as bad:  # the server idle: never a 429
        client.completions.create(model=MODEL, prompt=["hi"] * (MAX_QUEUE + 1), max_tokens=2)
    assert bad.value.param == "prompt" and bad.value.code == "batch_exceeds_max_queue"
    assert "--max-queue" in bad.value.message and str(MAX_QUEUE) in bad.value.message
    got = client.completions.create(model=MODEL, prompt=["hi"] * MAX_QUEUE, max_tokens=2)
    assert len(got.choices) == MAX_QUEUE


def test_the_red_team_schema_is_a_400_within_the_deadline_then_cached(
        hostile: Server) -> None:
    client = hostile.client()
    fmt = {"type": "json_schema",
           "json_schema": {"name": "big", "schema": json.loads(big_schema())}}
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_body={"response_format": fmt})
    took = time.monotonic() - t0
    assert bad.value.param == "response_format"
    assert bad.value.code == "grammar_compile_timeout" and f"{DEADLINE:g} s" in bad.value.message
    assert took < DEADLINE + 2.0, took
    assert _metric(hostile, "llmserve_grammar_compile_timeouts_total") == 1
    assert _metric(hostile, "llmserve_grammar_compiles_in_flight") == 1  # running on
    deadline = time.monotonic() + 60
    while _metric(hostile, "llmserve_grammar_compiles_in_flight") and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(hostile, "llmserve_grammar_compiles_in_flight") == 0
    assert _metric(hostile, "llmserve_grammar_cache_bytes") > 1 << 20
    # The compile that ran on serves the retry from the cache.
    again = client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      extra_body={"response_format": fmt})
    assert again.choices[0].finish_reason == "length"


@pytest.mark.parametrize("head", [
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"Content-Length: -1\r\n\r\n",
])
def test_malformed_requests_leave_no_traceback_in_the_log(hostile: Server, head: bytes) -> None:
    before = hostile.stderr()
    with socket.create_connection((HOST, hostile.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head)
        assert s.recv(4096).startswith(b"HTTP/1.0 400")
    deadline = time.monotonic() + 5
    while (new := hostile.stderr()[len(before):]).count("Error handling request") < 1 \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Traceback" not in new and "ERROR" not in new, new
    assert new.count("Error handling request") == 1, new
    assert hostile.call("GET", "/health/live").status == 200
