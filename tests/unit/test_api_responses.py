"""POST /v1/responses translated to the chat path, and its answers in the Responses shapes;
/tokenize and /detokenize over real HTTP (they need the tokenizer, not the engine).

The streamed events are read back by the `openai` client's own stream state (what
`client.responses.stream` runs), so a shape it cannot assemble fails here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from serve.api import HttpServerHandle, ServerState, start_http_server
from serve.api.protocol import ApiError
from serve.api.responses import (
    _Events,
    output_items,
    parse_responses_request,
    response_object,
    translate,
)
from tests.unit.test_api_server import assert_openai_error, call
from tests.unit.test_detok import build_tiny_tokenizer

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": True}


def test_text_input_and_instructions_become_chat_messages() -> None:
    r = translate({"model": "m", "input": "Hi", "instructions": "Be brief.",
                   "max_output_tokens": 20, "temperature": 0.5, "top_p": 0.9, "store": False})
    assert r.chat == {"messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}],
                      "max_tokens": 20, "model": "m", "temperature": 0.5, "top_p": 0.9}
    _, req = parse_responses_request({"input": "Hi", "max_output_tokens": 7, "stream": True})
    assert req.kind == "chat" and req.max_tokens == 7 and req.stream
    assert req.messages == ({"role": "user", "content": "Hi"},)


def test_item_list_with_a_function_call_round_trip() -> None:
    r = translate({"input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": "{\"city\": \"Lyon\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False})
    msgs = r.chat["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "user"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["call_1", "call_2"]
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": "{\"city\": \"Paris\"}"}
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert msgs[3]["content"] == "It is sunny." and msgs[4]["content"] == "Thanks"
    # Flat function tools in the chat's nested shape; the named choice likewise.
    assert r.chat["tools"] == [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters", "strict")}}]
    assert r.chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert r.chat["parallel_tool_calls"] is False
    assert r.echo["tools"] == [WEATHER]  # the answer repeats the flat shape


def test_text_format_becomes_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = translate({"input": "x", "text": {"format": {"type": "json_schema", "name": "A",
                                                     "schema": schema, "strict": True}}})
    assert r.chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "A", "schema": schema, "strict": True}}
    assert translate({"input": "x", "text": {"format": {"type": "json_object"}}}
                     ).chat["response_format"] == {"type": "json_object"}
    assert "response_format" not in translate({"input": "x", "text": {
        "format": {"type": "text"}}}).chat


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "stateless"),
    ({"input": "x", "store": True}, "store", "keeps no responses"),
    ({"input": "x", "seed": 1}, "seed", "not supported"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "not supported"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({}, "input", "required"),
    ({"input": 3}, "input", "string"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input",
     "input_image"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "call_id"),
    ({"input": "x", "instructions": 5}, "instructions", "string"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens", "integer"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools", "name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "mcp"}}, "tool_choice",
     "must be"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "json_schema"),
    ({"input": "x", "text": {"verbosity": "high"}}, "text", "verbosity"),
    ({"input": "x", "metadata": {"a": 1}}, "metadata", "strings"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options",
     "stream"),
    ({"input": "x", "temperature": 9}, "temperature", "temperature"),
    ({"input": "x", "top_p": "high"}, "top_p", "top_p"),
    # A function tool whose parameters are not a JSON Schema object: the chat path's 400,
    # named as the Responses field.
    ({"input": "x", "tools": [{**WEATHER, "parameters": "a string"}]}, "tools", "tools"),
])
def test_bad_or_unsupported_fields_are_400s_naming_them(body: dict[str, Any], param: str,
                                                        words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_responses_request(body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert words in info.value.message


def test_neutral_values_are_accepted() -> None:
    for body in ({"store": False}, {"background": False}, {"include": []},
                 {"truncation": "disabled"}, {"service_tier": "auto"}, {"top_logprobs": 0},
                 {"previous_response_id": None}, {"tool_choice": "auto"},
                 {"tool_choice": "none"}, {"tools": []}, {"text": {"verbosity": "medium"}},
                 {"metadata": {"k": "v"}, "user": "u", "safety_identifier": "s",
                  "prompt_cache_key": "p"}):
        parse_responses_request({"input": "x", **body})


def test_a_chat_answer_with_tool_calls_becomes_function_call_items() -> None:
    message = {"role": "assistant", "content": None, "reasoning_content": "Paris, so...",
               "tool_calls": [{"id": "call_9", "type": "function", "function": {
                   "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    items = output_items(message)
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Paris, so..."}]
    call = items[1]
    assert (call["call_id"], call["name"], call["arguments"]) == (
        "call_9", "get_weather", "{\"city\": \"Paris\"}")
    resp = translate({"input": "x", "tools": [WEATHER]})
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 2}}
    body = response_object(resp, "resp_1", 1, "m", items, "tool_calls", usage)
    parsed = Response.model_validate(body)  # the openai client's own model, strictly
    assert parsed.status == "completed" and parsed.output_text == ""
    assert parsed.output[1].type == "function_call" and parsed.usage.input_tokens == 5
    assert parsed.usage.input_tokens_details.cached_tokens == 2
    text = response_object(resp, "resp_2", 1, "m", output_items({"content": "Hi"}), "length",
                           usage)
    parsed = Response.model_validate(text)
    assert parsed.output_text == "Hi" and parsed.status == "incomplete"
    assert parsed.incomplete_details.reason == "max_output_tokens"


class _Wire:
    def __init__(self) -> None:
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data


def _events(wire: _Wire) -> list[dict[str, Any]]:
    out = []
    for block in wire.data.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            out.append(event)
    return out


def test_streamed_chat_deltas_become_events_the_openai_client_assembles() -> None:
    resp = translate({"input": "x", "tools": [WEATHER]})
    wire = _Wire()
    events = _Events(wire)  # type: ignore[arg-type]
    start = response_object(resp, "resp_1", 1, "m", [], None, None)
    deltas = [{"reasoning_content": "Think"}, {"reasoning_content": "ing."},
              {"content": "Let me"}, {"content": " check."},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}]

    async def run() -> None:
        await events.send("response.created", response=start)
        await events.send("response.in_progress", response=start)
        for delta in deltas:
            await events.delta(delta)
        await events.close()
        done = response_object(resp, "resp_1", 1, "m", events.items, "tool_calls",
                               {"prompt_tokens": 1, "completion_tokens": 2})
        await events.send("response.completed", response=done)

    asyncio.run(run())
    raw = _events(wire)
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
    state = ResponseStreamState(input_tools=[WEATHER], text_format=omit)  # type: ignore
    seen = [e.type for event in raw
            for e in state.handle_event(construct_type(type_=ResponseStreamEvent,
                                                        value=event))]
    assert seen[:3] == ["response.created", "response.in_progress",
                        "response.output_item.added"]
    assert "response.output_text.delta" in seen and seen[-1] == "response.completed"
    final = state._completed_response
    assert final is not None
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me check."
    assert final.output[2].arguments == "{\"city\": \"Paris\"}"
    assert final.output[0].content[0].text == "Thinking."


# ---- over HTTP, before admission (no engine): /tokenize, /detokenize, and the 400s --------


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def server(tokenizer) -> Iterator[HttpServerHandle]:
    state = ServerState(model_name="tiny", tokenizer=tokenizer, max_seq_len=64, max_queue=4)
    handle = start_http_server(state, "127.0.0.1", 0)
    yield handle
    handle.stop(5)


def test_tokenize_a_prompt_and_detokenize_it_back(server, tokenizer) -> None:
    status, _, raw = call(server.port, "POST", "/tokenize",
                          {"prompt": "hello world", "return_token_strs": True})
    assert status == 200, raw
    out = json.loads(raw)
    assert out["tokens"] == tokenizer("hello world")["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 64
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    status, _, raw = call(server.port, "POST", "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and json.loads(raw) == {"prompt": tokenizer.decode(out["tokens"])}


def test_tokenize_messages_counts_what_the_chat_endpoint_feeds_the_model(server, tokenizer
                                                                         ) -> None:
    messages = [{"role": "user", "content": "hello"}]
    status, _, raw = call(server.port, "POST", "/tokenize", {"messages": messages})
    assert status == 200, raw
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert json.loads(raw)["tokens"] == list(expected)
    assert json.loads(raw)["token_strs"] is None
    _, _, raw = call(server.port, "POST", "/tokenize", {"messages": messages,
                                                         "add_generation_prompt": False})
    assert json.loads(raw)["count"] < len(expected)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
     "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "b"}]}, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "tools": []}, "tools"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [1], "skip": True}, "skip"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"},
     "previous_response_id"),
    ("/v1/responses", {"input": "x", "store": True}, "store"),
    ("/v1/responses", {"input": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/responses", {"input": [{"role": "user", "content": 5}]}, "input"),
])
def test_bad_bodies_are_openai_400s_naming_the_field(server, path: str, body: dict,
                                                     param: str) -> None:
    status, _, raw = call(server.port, "POST", path, body)
    err = assert_openai_error(status, raw, 400)
    assert err["param"] == param, err


def test_unknown_model_is_404_and_a_valid_response_request_waits_for_admission(server
                                                                               ) -> None:
    status, _, raw = call(server.port, "POST", "/tokenize", {"model": "gpt", "prompt": "a"})
    assert assert_openai_error(status, raw, 404)["param"] == "model"
    status, _, raw = call(server.port, "POST", "/v1/responses", {"input": "hello"})
    assert_openai_error(status, raw, 503)
