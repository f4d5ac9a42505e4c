"""Malformed and abusive requests, client disconnects and /metrics on the shared server."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from serve.gates import GATE_NAMES
from tests.e2e.conftest import MAX_SEQ_LEN, MODEL, Reference, usage_of
from tests.e2e.harness import Body, Server
from tests.unit.test_metrics import parse as parse_metrics

C, CHAT = "/v1/completions", "/v1/chat/completions"
HUGE = 2 << 20  # twice the 1 MiB body limit
LONG_PROMPT = "emoji 🙂 and ✓ marks, Grüße aus München " * 40  # far over 256 tokens


def _c(**fields: object) -> dict:
    return {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4, **fields}


def _chat(**fields: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


# id, method, path, body, status, param, code, words the message must hold
CASES: list[tuple[str, str, str, Body, int, str | None, str | None, tuple[str, ...]]] = [
    ("bad-json", "POST", C, b'{"model": "tiny-chat", "prompt": "hi",', 400, None, "invalid_json", ("JSON",)),
    ("body-is-an-array", "POST", C, b'["prompt", "hi"]', 400, None, "invalid_type", ("object",)),
    ("body-not-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', 400, None, "invalid_json", ()),
    ("nested-100k-deep", "POST", C, b"[" * 100_000 + b"]" * 100_000, 400, None, "invalid_json", ()),
    ("missing-prompt", "POST", C, {"model": MODEL}, 400, "prompt", "missing_required_parameter", ()),
    ("prompt-is-a-number", "POST", C, _c(prompt=42), 400, "prompt", "invalid_type", ()),
    ("empty-prompt", "POST", C, _c(prompt=""), 400, "prompt", None, ("empty",)),
    ("token-id-out-of-range", "POST", C, _c(prompt=[5, 6, 10**6]), 400, "prompt", None, ("1000000",)),
    ("max-tokens-a-string", "POST", C, _c(max_tokens="ten"), 400, "max_tokens", "invalid_type", ()),
    ("max-tokens-negative", "POST", C, _c(max_tokens=-5), 400, "max_tokens", None, ("-5",)),
    ("max-tokens-zero", "POST", C, _c(max_tokens=0), 400, "max_tokens", None, ()),
    ("max-tokens-huge", "POST", C, _c(max_tokens=10**9), 400, "max_tokens",
     "context_length_exceeded", ("1000000000", str(MAX_SEQ_LEN))),
    ("max-tokens-beyond-int64", "POST", C, _c(max_tokens=2**70), 400, "max_tokens",
     "context_length_exceeded", ()),
    ("prompt-too-long", "POST", C, _c(prompt=LONG_PROMPT, max_tokens=1), 400, "prompt",
     "context_length_exceeded", (str(MAX_SEQ_LEN),)),
    ("unknown-model", "POST", C, _c(model="gpt-4"), 404, "model", "model_not_found", ("gpt-4",)),
    ("n-500", "POST", C, _c(n=500), 400, "n", None, ()),
    ("temperature-too-high", "POST", C, _c(temperature=5), 400, "temperature", None, ()),
    ("temperature-a-string", "POST", C, _c(temperature="hot"), 400, "temperature", "invalid_type", ()),
    ("temperature-nan", "POST", C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", None, ()),
    ("top-p-zero", "POST", C, _c(top_p=0), 400, "top_p", None, ()),
    ("seed-negative", "POST", C, _c(seed=-1), 400, "seed", None, ()),
    ("five-stop-strings", "POST", C, _c(stop=list("abcde")), 400, "stop", None, ()),
    ("stream-options-without-stream", "POST", C, _c(stream_options={"include_usage": True}),
     400, "stream_options", None, ()),
    ("logprobs-21", "POST", C, _c(logprobs=21), 400, "logprobs", None, ()),
    ("suffix", "POST", C, _c(suffix="tail"), 400, "suffix", "unsupported_parameter", ()),
    ("max-tokens-zero-without-echo", "POST", C, _c(max_tokens=0, logprobs=1), 400,
     "max_tokens", None, ()),
    ("best-of-below-n", "POST", C, _c(n=3, best_of=2), 400, "best_of", None, ()),
    ("n-beyond-the-batch", "POST", C, _c(n=100), 400, "n", "unsupported_parameter", ("16",)),
    ("logit-bias-out-of-vocab", "POST", C, _c(logit_bias={"999999": 5}), 400, "logit_bias",
     None, ("999999",)),
    # Lone surrogates (JSON's \ud800 escape): a TypeError in the tokenizer and a 500 before.
    ("prompt-lone-surrogate", "POST", C, _c(prompt="hi \ud800"), 400, "prompt", "invalid_text",
     ("'prompt'",)),
    ("batch-lone-surrogate", "POST", C, _c(prompt=["ok", "\udfff"]), 400, "prompt",
     "invalid_text", ("'prompt[1]'",)),
    ("chat-lone-surrogate", "POST", CHAT, _chat(messages=[{"role": "user", "content": "hi \ud800"}]),
     400, "messages", "invalid_text", ("'messages[0].content'",)),
    ("bad-json-schema", "POST", C, _c(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}), 400, "response_format",
     None, ()),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, _chat(top_logprobs=2), 400,
     "top_logprobs", None, ()),
    ("chat-echo", "POST", CHAT, _chat(echo=True), 400, "echo", "unsupported_parameter", ()),
    ("chat-messages-a-string", "POST", CHAT, _chat(messages="hi"), 400, "messages", "invalid_type", ()),
    ("chat-no-messages", "POST", CHAT, _chat(messages=[]), 400, "messages", None, ()),
    ("chat-unknown-role", "POST", CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]),
     400, "messages", None, ("wizard",)),
    ("chat-image-part", "POST", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages", None, ()),
    ("chat-max-completion-tokens-zero", "POST", CHAT, _chat(max_completion_tokens=0), 400,
     "max_completion_tokens", None, ()),
    ("chat-unknown-model", "POST", CHAT, _chat(model="nope"), 404, "model", "model_not_found", ()),
    ("oversized-body", "POST", C, b'{"prompt": "' + b"a" * HUGE + b'"}', 413, None, None, ()),
    ("oversized-chunked-body", "POST", C, [b'{"prompt": "', *[b"a" * 65536] * (HUGE // 65536), b'"}'],
     413, None, None, ()),
    ("unknown-route", "POST", "/v1/embeddings", _c(), 404, None, None, ("/v1/embeddings",)),
    ("wrong-method", "GET", C, None, 405, None, None, ("GET",)),
    ("unknown-model-card", "GET", "/v1/models/gpt-4", None, 404, "model", "model_not_found", ()),
]


def _check_error(server: Server, case: tuple) -> None:
    name, method, path, body, status, param, code, words = case
    reply = server.call(method, path, body)
    assert reply.status == status, (name, reply)
    assert reply.headers["content-type"].startswith("application/json"), name
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, (name, err)
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] == param, (name, err)
    if code is not None:
        assert err["code"] == code, (name, err)
    for word in words:
        assert word in err["message"], (name, err)
    if status == 405:
        assert "POST" in reply.headers["allow"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_an_openai_shaped_4xx(server: Server, case: tuple) -> None:
    _check_error(server, case)


def test_the_openai_client_sees_typed_errors(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=500)
    assert bad.value.status_code == 400 and bad.value.param == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_SEQ_LEN)
    assert long.value.code == "context_length_exceeded" and str(MAX_SEQ_LEN) in long.value.message


def test_abuse_does_not_disturb_a_running_request_and_the_server_keeps_serving(
        server: Server, reference: Reference) -> None:
    prompt = "Héllo wörld, ça va? Grüße"
    want = reference.completion(prompt, 100)
    result: dict[str, object] = {}

    def stream() -> None:
        chunks = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=100,
                                                    temperature=0, stream=True)
        result["text"] = "".join(c.choices[0].text for c in chunks if c.choices)

    t = threading.Thread(target=stream)
    t.start()
    for case in CASES:
        _check_error(server, case)
    t.join(60)
    assert result.get("text") == want.text
    after = server.client().completions.create(model=MODEL, prompt="The quick brown fox",
                                               max_tokens=16, temperature=0)
    assert after.choices[0].text == reference.completion("The quick brown fox", 16).text


def _metric(text: str, name: str, **labels: str) -> float:
    return parse_metrics(text).value(name, **labels)  # the parse refuses duplicate series


def test_client_disconnect_mid_stream_cancels_the_request(server: Server) -> None:
    n = 240  # about 3 s of decoding here: far longer than the wait below
    stream = server.client().completions.create(model=MODEL, prompt="The quick", max_tokens=n,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].text)
        if seen == 3:
            break
    assert _metric(server.metrics(), "llmserve_num_requests_running") == 1
    stream.close()  # the client goes away mid-stream
    closed = time.monotonic()
    while _metric(text := server.metrics(), "llmserve_num_requests_running") != 0:
        assert time.monotonic() - closed < 1.5, "the request was not cancelled"
        time.sleep(0.05)
    assert _metric(text, "llmserve_kv_cache_usage_ratio") == 0  # its KV blocks are free
    # None in use; its full blocks stay in the prefix cache, reported apart.
    assert _metric(text, "llmserve_kv_cache_blocks", state="used") == 0
    assert _metric(text, "llmserve_kv_cache_blocks", state="cached") > 0
    # Sampled at the default temperature, a stop token may come early: ask for exactly 3.
    again = server.client().completions.create(model=MODEL, prompt="The quick", max_tokens=3,
                                               extra_body={"ignore_eos": True})
    assert again.usage.completion_tokens == 3


def test_metrics_count_traffic_and_expose_gate_durations(server: Server) -> None:
    before = server.metrics()
    got = server.client().completions.create(model=MODEL, prompt="The lazy dog", max_tokens=12,
                                             temperature=0)
    assert server.call("POST", C, b"{").status == 400
    text = server.metrics()
    types = parse_metrics(text).types
    # Ours, and the endpoint picker's series under vLLM's names (serve/metrics.py).
    picker = {"vllm:num_requests_waiting", "vllm:num_requests_running",
              "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}
    assert all(n.startswith("llmserve_") for n in set(types) - picker), sorted(types)
    assert all(types.get(n) == "gauge" for n in picker), sorted(types)
    for name, kind in [("time_to_first_token_seconds", "histogram"),
                       ("inter_token_latency_seconds", "histogram"),
                       ("e2e_request_latency_seconds", "histogram"),
                       ("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"),
                       ("kv_cache_usage_ratio", "gauge"), ("num_preemptions_total", "counter"),
                       ("prompt_tokens_total", "counter"), ("generation_tokens_total", "counter"),
                       ("request_success_total", "counter"), ("startup_gate_seconds", "gauge")]:
        assert types.get(f"llmserve_{name}") == kind, name

    def delta(name: str, **labels: str) -> float:
        old = parse_metrics(before).get(name, **labels)
        return _metric(text, name, **labels) - (old or 0.0)

    prompt_tokens, completion_tokens = usage_of(got)
    assert delta("llmserve_prompt_tokens_total") == prompt_tokens
    assert delta("llmserve_generation_tokens_total") == completion_tokens == 12
    assert delta("llmserve_request_success_total", finished_reason="length") == 1
    assert delta("llmserve_time_to_first_token_seconds_count") == 1
    assert delta("llmserve_e2e_request_latency_seconds_count") == 1
    assert delta("llmserve_inter_token_latency_seconds_count") == completion_tokens - 1
    assert delta("llmserve_http_requests_total", route="/v1/completions", status="400") == 1
    assert _metric(text, "llmserve_num_requests_running") == 0
    gates = {g["name"]: g["seconds"] for g in server.call("GET", "/v1/engine").json()["gates"]}
    for gate in GATE_NAMES:
        value = _metric(text, "llmserve_startup_gate_seconds", gate=gate)
        assert value == pytest.approx(gates[gate]) and value >= 0, gate
    assert gates["kernels"] > 0 and gates["load"] > 0
