"""Tool calling without a model (serve/api/tools.py): request validation, the parsers on
recorded outputs of each format, the streamed deltas, and the grammars that make `required`
and named calls valid (checked with xgrammar's matcher against accepted and refused text)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from serve.api.protocol import ApiError, parse_chat_request
from serve.api.tools import (
    ToolStream,
    detect_format,
    generic_schema,
    parse_output,
    prepare,
)

MSG = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}

# Recorded outputs (Qwen2.5-7B-Instruct, Hermes-3, Llama-3.1-8B-Instruct, Mistral-7B v0.3 and
# Mistral Small 3.1, as vLLM's parser tests record them) and what they parse to.
RECORDED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>', "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
     '</tool_call>', "", [("get_weather", {"city": "Paris", "unit": "c"}),
                         ("get_time", {"tz": "CET"})]),
    ("hermes", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": ', None, []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "CET"}}', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("llama3_json", "The weather is {fine}.", "The weather is {fine}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", {"city": "Paris"})]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Sure.",
     [("get_weather", {"city": "Paris"})]),
    ("mistral", '[{"name": "get_time", "arguments": {"tz": "CET"}}]', "",
     [("get_time", {"tz": "CET"})]),
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
     "", [("get_weather", {"city": "Paris"})]),
    ("generic", '{"response": "It is \\"sunny\\" \\u00e9t\\u00e9"}', 'It is "sunny" été', []),
    ("generic", '{"response": "cut sho', "cut sho", []),
    ("generic", '{"tool_calls": [{"name": "get_time", "arguments": {"tz": "CET"}}, {"name": '
     '"get_time", "argu', "", [("get_time", {"tz": "CET"})]),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), RECORDED)
def test_parsers_on_recorded_outputs(fmt: str, text: str, content: str | None,
                                     calls: list[tuple[str, dict]]) -> None:
    got_content, got = parse_output(fmt, text)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (text if content is None else content)
    assert all(c.id.startswith("call_") for c in got)
    assert len({c.id for c in got}) == len(got)


_CUT = [r for r in RECORDED if r[0] == "generic" and not r[1].endswith("}")]  # max_tokens


def _assemble(fmt: str, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    """Feed `text` in pieces of `step` characters and assemble the deltas as the openai
    client's stream helpers do (by index: id, name once, arguments concatenated)."""
    stream, content, calls = ToolStream(fmt), "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        delta = stream.push(piece, final=k == len(pieces) - 1)
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"arguments": ""})
            if "id" in entry:
                assert "id" not in call, "an id is sent once"
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            assert "id" in call, "the first entry of a call carries its id and name"
            call["arguments"] += entry.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"),
                         [r for r in RECORDED if r[2] is not None and r not in _CUT])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_deltas_assemble_to_the_parsed_message(fmt: str, text: str, content: str,
                                                        calls: list, step: int) -> None:
    got_content, got = _assemble(fmt, text, step)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
    assert got_content.strip() == content


def test_generic_streams_arguments_before_the_call_ends() -> None:
    stream = ToolStream("generic")
    first = stream.push('{"tool_calls": [{"name": "get_weather", "arguments": {"ci')
    entry = first["tool_calls"][0]
    assert entry["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert stream.push('ty": "Paris"}')["tool_calls"] == [
        {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]
    assert stream.push("}]}", final=True) == {}


def _chat(**extra: Any) -> Any:
    return parse_chat_request({"messages": MSG, **extra})


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
        "name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"function": "get_weather"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [*MSG, {"role": "tool", "content": "sunny"}]}, "messages"),
    ({"messages": [*MSG, {"role": "assistant", "tool_calls": [{"id": "1", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages"),
])
def test_bad_tool_fields_are_400s_naming_them(extra: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        _chat(**extra)
    assert (info.value.status, info.value.param) == (400, param)


def test_tool_choice_none_and_no_tools_ask_for_nothing() -> None:
    assert _chat(tools=[WEATHER], tool_choice="none").tools is None
    assert _chat(tool_choice="none", parallel_tool_calls=False).tools is None
    spec = _chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                     "function": {"name": "get_time"}}).tools
    assert spec.named and spec.must_call and [t.name for t in spec.allowed()] == ["get_time"]


def test_the_generic_format_describes_the_tools_and_keeps_the_conversation() -> None:
    req = _chat(tools=[WEATHER], tool_choice="required", messages=[
        {"role": "system", "content": "Be brief."}, *MSG,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1",
         "type": "function", "function": {"name": "get_weather",
                                          "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    out = prepare(req, "{{ messages }}", None)
    assert out.tools.fmt == "generic" and out.guided_param == "tools"
    system, _, assistant, result = out.messages
    assert system["content"].startswith("Be brief.") and "get_weather" in system["content"]
    assert json.loads(assistant["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert json.loads(result["content"]) == {"tool_response": {
        "tool": "get_weather", "tool_call_id": "call_1", "content": "sunny, 21 C"}}
    schema = json.loads(out.guided.value)
    ok = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    jsonschema.validate(ok, schema)
    for wrong in ({"response": "hi"}, {"tool_calls": []},
                  {"tool_calls": [{"name": "get_weather", "arguments": {}}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_generic_auto_allows_a_message_and_parallel_false_one_call() -> None:
    spec = _chat(tools=[WEATHER, TIME], parallel_tool_calls=False).tools
    schema = generic_schema(spec)
    jsonschema.validate({"response": "hello"}, schema)
    one = {"name": "get_time", "arguments": {"tz": "CET"}}
    jsonschema.validate({"tool_calls": [one]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [one, one]}, schema)


def test_templates_choose_their_format() -> None:
    assert detect_format(None) == "generic"
    assert detect_format("{{ messages }}") == "generic"  # SmolLM2's kind: no tools
    assert detect_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}") == "mistral"
    assert detect_format("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"


def test_response_format_with_tools_is_a_400() -> None:
    req = _chat(tools=[WEATHER], response_format={"type": "json_object"})
    with pytest.raises(ApiError) as info:
        prepare(req, None, None)
    assert info.value.param == "response_format"


def _accepts(ebnf: str, text: str) -> bool:
    import xgrammar as xgr

    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text)


@pytest.mark.parametrize(("fmt", "parallel", "good", "bad"), [
    ("hermes", True,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'),
    ("hermes", False,
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'),
    ("mistral", True, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"town": "Paris"}}]'),
    ("llama3_json", True, '{"name": "get_time", "parameters": {"tz": "CET"}}',
     '{"name": "get_time", "arguments": {"tz": "CET"}}'),
])
def test_required_grammars_accept_valid_calls_only(fmt: str, parallel: bool, good: str,
                                                   bad: str) -> None:
    req = _chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
    out = prepare(req, None, fmt)
    assert out.guided.kind == "grammar"
    assert _accepts(out.guided.value, good)
    assert not _accepts(out.guided.value, bad)
    assert parse_output(fmt, good)[1]


def test_a_named_call_grammar_allows_that_function_only() -> None:
    req = _chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                    "function": {"name": "get_time"}})
    out = prepare(req, None, "hermes")
    assert out.guided_param == "tool_choice"
    assert _accepts(out.guided.value, '<tool_call>\n{"name": "get_time", "arguments": '
                    '{"tz": "UTC"}}\n</tool_call>')
    assert not _accepts(out.guided.value, '<tool_call>\n{"name": "get_weather", "arguments": '
                        '{"city": "Paris"}}\n</tool_call>')


# ---- auto in the template formats: free text, then every call constrained ------------------

_PIECE = r"<tool_call>|</tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>|\w+|\s|."


def _walk(ebnf: str, text: str) -> tuple[list[str], int, bool]:
    """`text` cut into tokens (markers whole, as in the models' vocabularies) and fed one by
    one to a GrammarMatcher over that tiny vocabulary: the tokens, how many were accepted,
    and whether the output may end there (the stop token accepted)."""
    import re

    import xgrammar as xgr

    pieces = re.findall(_PIECE, text)
    vocab = sorted(set(pieces) | {"</s>"})
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[vocab.index("</s>")])
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf))
    for k, piece in enumerate(pieces):
        if not matcher.accept_token(vocab.index(piece)):
            return pieces, k, False
    return pieces, len(pieces), matcher.accept_token(vocab.index("</s>"))


def _auto(fmt: str, parallel: bool = True) -> Any:
    out = prepare(_chat(tools=[WEATHER, TIME], parallel_tool_calls=parallel), None, fmt)
    assert (out.guided.kind, out.guided_param) == ("grammar", "tools")
    return out.guided.value


@pytest.mark.parametrize(("fmt", "text"), [
    ("hermes", "It is sunny in Paris, 21 C. Anything else?"),
    ("mistral", "Paris: sunny [source: meteo], {21 C}."),
    ("llama3_json", "The weather is {fine}; see <b>this</b>."),
])
def test_auto_grammars_leave_text_free(fmt: str, text: str) -> None:
    pieces, accepted, ends = _walk(_auto(fmt), text)
    assert accepted == len(pieces) and ends
    assert parse_output(fmt, text) == (text, [])


@pytest.mark.parametrize(("fmt", "parallel", "text", "calls"), [
    ("hermes", True, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
     '{"tz": "CET"}}\n</tool_call>', ["get_weather", "get_time"]),
    ("hermes", False, 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
     '</tool_call>', ["get_time"]),
    ("mistral", True, 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]', ["get_weather", "get_time"]),
    ("mistral", True, '[{"name": "get_time", "arguments": {"tz": "CET"}}]', ["get_time"]),
    ("llama3_json", True, '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     ["get_weather"]),
    ("llama3_json", True, '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}',
     ["get_time"]),
])
def test_auto_grammars_accept_valid_calls_after_text(fmt: str, parallel: bool, text: str,
                                                     calls: list[str]) -> None:
    pieces, accepted, ends = _walk(_auto(fmt, parallel), text)
    assert accepted == len(pieces) and ends
    assert [c.name for c in parse_output(fmt, text)[1]] == calls


@pytest.mark.parametrize(("fmt", "parallel", "text", "trigger"), [
    # arguments off the schema, an unknown tool, a second call with parallel calls off
    ("hermes", True, 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
     '{"town": "Paris"}}\n</tool_call>', "<tool_call>"),
    ("hermes", True, 'Hm. <tool_call>\n{"name": "get_news", "arguments": {}}\n</tool_call>',
     "<tool_call>"),
    ("hermes", True, '<tool_call>\n{"name":"get_time","arguments":{"tz":"CET"}}\n</tool_call>',
     "<tool_call>"),
    ("hermes", False, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
     '</tool_call>', "</tool_call>"),
    ("mistral", True, 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"unit": '
     '"c"}}]', "[TOOL_CALLS]"),
    ("mistral", True, '[{"name": "get_time", "arguments": {"tz": 1}}]', "["),
    ("llama3_json", True, '{"name": "get_weather", "parameters": {"city": 7}}', "{"),
    ("llama3_json", True, '{"name": "get_time", "arguments": {"tz": "CET"}}', "{"),
])
def test_auto_grammars_refuse_an_invalid_call_once_started(fmt: str, parallel: bool,
                                                           text: str, trigger: str) -> None:
    pieces, accepted, ends = _walk(_auto(fmt, parallel), text)
    assert not ends and pieces.index(trigger) < accepted < len(pieces), (pieces, accepted)


def test_auto_keeps_response_format_and_a_backend_without_grammars_parses_only() -> None:
    req = _chat(tools=[WEATHER], response_format={"type": "json_object"})
    assert prepare(req, None, "hermes").guided == req.guided  # theirs, calls parsed
    assert prepare(_chat(tools=[WEATHER]), None, "hermes", constrain_auto=False).guided is None
    # required stays a grammar of calls only, whatever the backend (it refuses grammars)
    req = _chat(tools=[WEATHER], tool_choice="required")
    assert prepare(req, None, "hermes", constrain_auto=False).guided.kind == "grammar"
