"""Issue 37's hostile inputs at the validation functions and over real HTTP on 127.0.0.1
(no executor: everything they exercise happens before admission).

- Text that cannot be encoded (a lone surrogate from JSON's \\ud800) is a 400 naming the
  field on both endpoints; a property test over prompt and message strings: never a 5xx.
- A completions batch larger than --max-queue can never be admitted: a 400, not a 429.
- A grammar that does not compile within the deadline is a 400 naming the field.
- Requests aiohttp's parser refuses are logged in one INFO line, without a traceback.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.core.grammar import GrammarConfig
from runtime.tokenizer import FastTokenizer
from serve.api import HttpServerHandle, ServerState, start_http_server
from serve.api.generate import _prepare, dumps
from serve.api.protocol import ApiError, parse_chat_request, parse_completion_request
from tests.unit.test_api_server import assert_openai_error, call
from tests.unit.test_detok import build_tiny_tokenizer
from tests.unit.test_grammar import big_schema
from tests.unit.test_metrics import parse as parse_metrics

C, CHAT = "/v1/completions", "/v1/chat/completions"

# Any text, half of it with lone surrogates (they are what broke the tokenizer). Those are
# joined from a list: st.text() all but never yields a surrogate, whatever its alphabet.
CHARS = st.one_of(st.characters(codec=None, exclude_categories=[]),
                  st.characters(codec=None, categories=["Cs"]))
TEXT = st.one_of(st.text(max_size=40), st.lists(CHARS, max_size=40).map("".join))


@pytest.fixture(scope="module")
def fast_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> FastTokenizer:
    """The tokenizer the server loads (runtime/tokenizer.py), from real tokenizer files."""
    out: Path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer().save_pretrained(out)
    return FastTokenizer(out)


def _validate(state: ServerState, kind: str, body: dict[str, Any]) -> None:
    """What the server does with a body before admission; ApiError or nothing."""
    req = parse_chat_request(body) if kind == "chat" else parse_completion_request(body)
    _prepare(state, req)


def _no_5xx(state: ServerState, kind: str, body: dict[str, Any]) -> None:
    try:
        _validate(state, kind, body)
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc.body()
        dumps(exc.body()).encode()  # the error itself can be written back
    # Anything else (TypeError from the tokenizer, a jinja error) fails the test.


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=4)),
       content=TEXT, stop=st.lists(TEXT, max_size=2))
def test_no_prompt_or_message_text_is_a_5xx(fast_tokenizer, prompt, content, stop) -> None:
    state = ServerState(model_name="tiny", tokenizer=fast_tokenizer, max_seq_len=64)
    _no_5xx(state, "completion", {"prompt": prompt, "max_tokens": 2, "stop": stop})
    _no_5xx(state, "chat", {"messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": content}],
                            "max_tokens": 2, "stop": stop})
    _no_5xx(state, "chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": content}, {"type": "text", "text": "x"}]}]})


@pytest.mark.parametrize(("kind", "body", "param", "where"), [
    ("completion", {"prompt": "hi \ud800", "max_tokens": 2}, "prompt", "'prompt'"),
    ("completion", {"prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt", "'prompt[1]'"),
    ("chat", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages",
     "'messages[0].content'"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages", "'messages[0].content[0].text'"),
    ("completion", {"prompt": "hi", "stop": ["\ud800"]}, "stop", "'stop[0]'"),
    ("completion", {"prompt": "hi", "user": "\udc80"}, "user", "'user'"),
    ("completion", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"\ud800": {}}}}}},
     "response_format", "'response_format.json_schema.schema.properties (a name)'"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(fast_tokenizer, kind, body, param,
                                                    where) -> None:
    state = ServerState(model_name="tiny", tokenizer=fast_tokenizer, max_seq_len=64)
    with pytest.raises(ApiError) as info:
        _validate(state, kind, body)
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, "invalid_text"), err.body()
    assert where in err.message and "surrogate" in err.message


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ServerState, HttpServerHandle]]:
    state = ServerState(model_name="tiny", tokenizer=build_tiny_tokenizer(), max_seq_len=64,
                        max_queue=4, grammar=GrammarConfig(compile_timeout_s=0.3))
    handle = start_http_server(state, "127.0.0.1", 0)
    yield state, handle
    handle.stop(5)


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    # json.dumps escapes a lone surrogate as \ud800, as every JSON client sends it.
    return call(port, "POST", path, json.dumps(body), {"Content-Type": "application/json"})


def test_surrogates_over_http_are_400s_on_both_endpoints(server) -> None:
    _, handle = server
    for path, body, param in [
            (C, {"model": "tiny", "prompt": "hi \ud800", "max_tokens": 2}, "prompt"),
            (C, {"model": "tiny", "prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt"),
            (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi \ud800"}]},
             "messages")]:
        status, _, raw = _post(handle.port, path, body)
        err = assert_openai_error(status, raw, 400, "invalid_request_error")
        assert err["param"] == param and err["code"] == "invalid_text", err


def test_a_batch_larger_than_the_queue_is_a_400_not_a_429(server) -> None:
    state, handle = server
    state.readiness.set("ready")  # no executor: anything admissible would get a 503
    status, headers, raw = _post(handle.port, C, {"prompt": ["a"] * 5, "max_tokens": 1})
    err = assert_openai_error(status, raw, 400, "invalid_request_error")
    assert err["param"] == "prompt" and err["code"] == "batch_exceeds_max_queue"
    assert "--max-queue" in err["message"] and "4" in err["message"]
    assert "Retry-After" not in headers
    status, _, raw = _post(handle.port, C, {"prompt": ["a"] * 4, "max_tokens": 1})
    assert status == 503, raw  # four fit: on to admission


def test_a_grammar_past_its_deadline_is_a_400_and_counted(server) -> None:
    _, handle = server
    fmt = {"type": "json_schema", "json_schema": {"name": "big",
                                                  "schema": json.loads(big_schema())}}
    t0 = time.monotonic()
    status, _, raw = _post(handle.port, C, {"prompt": "hi", "response_format": fmt})
    took = time.monotonic() - t0
    err = assert_openai_error(status, raw, 400, "invalid_request_error")
    assert err["param"] == "response_format" and err["code"] == "grammar_compile_timeout"
    assert "0.3 s" in err["message"]
    assert took < 0.3 + 2.0, took
    page = parse_metrics(call(handle.port, "GET", "/metrics")[2].decode())
    assert page.value("llmserve_grammar_compile_timeouts_total") == 1
    assert page.value("llmserve_grammar_compiles_in_flight") == 1  # running on
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        page = parse_metrics(call(handle.port, "GET", "/metrics")[2].decode())
        if page.value("llmserve_grammar_compiles_in_flight") == 0:
            break
        time.sleep(0.1)
    assert page.value("llmserve_grammar_cache_entries") == 1
    assert page.value("llmserve_grammar_cache_bytes") > 1 << 20


@pytest.mark.parametrize("head", [
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"Content-Length: -1\r\n\r\n",
])
def test_a_malformed_request_is_one_info_line_without_a_traceback(server, caplog, head) -> None:
    _, handle = server
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head)
            assert s.recv(4096).startswith(b"HTTP/1.0 400")
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 1, records
    (rec,) = records
    assert rec.levelno == logging.INFO and rec.exc_info is None
    assert "\n" not in rec.getMessage() and "400" in rec.getMessage()
