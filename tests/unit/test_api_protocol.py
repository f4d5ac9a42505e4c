"""OpenAI request validation (pure functions) and tokenizer-dependent preparation."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from serve.api.prompt import build_sampling_params, encode_prompt
from serve.api.protocol import (
    ApiError,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from tests.unit.test_detok import build_tiny_tokenizer

MSG = [{"role": "user", "content": "hi"}]
C = "completion"
CHAT = "chat"

# (endpoint, body, status, error type, param). Every row is a request a client or an
# attacker could send; none may reach the engine.
MALFORMED: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    (C, {}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": ""}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": []}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": 42}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": ["a", ""]}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": [[1, 2], []]}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": ["x"] * 65}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": [1, -2, 3]}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": [1, True]}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": [1, 2.5]}, 400, "invalid_request_error", "prompt"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -5}, 400, "invalid_request_error", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": "16"}, 400, "invalid_request_error", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": True}, 400, "invalid_request_error", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 1.5}, 400, "invalid_request_error", "max_tokens"),
    (C, {"prompt": "x", "temperature": 2.5}, 400, "invalid_request_error", "temperature"),
    (C, {"prompt": "x", "temperature": -0.1}, 400, "invalid_request_error", "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "invalid_request_error", "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "invalid_request_error", "top_p"),
    (C, {"prompt": "x", "top_p": 1.01}, 400, "invalid_request_error", "top_p"),
    (C, {"prompt": "x", "top_k": -2}, 400, "invalid_request_error", "top_k"),
    (C, {"prompt": "x", "seed": -1}, 400, "invalid_request_error", "seed"),
    (C, {"prompt": "x", "seed": 2**64}, 400, "invalid_request_error", "seed"),
    (C, {"prompt": "x", "n": 0}, 400, "invalid_request_error", "n"),
    (C, {"prompt": "x", "n": 129}, 400, "invalid_request_error", "n"),
    (C, {"prompt": "x", "n": 3, "best_of": 2}, 400, "invalid_request_error", "best_of"),
    (C, {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, 400, "invalid_request_error",
     "best_of"),
    (C, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_request_error",
     "stop"),
    (C, {"prompt": "x", "stop": [""]}, 400, "invalid_request_error", "stop"),
    (C, {"prompt": "x", "stop": 7}, 400, "invalid_request_error", "stop"),
    (C, {"prompt": "x", "stop": ["a", 1]}, 400, "invalid_request_error", "stop"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "invalid_request_error", "stream"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "invalid_request_error", "stream_options"),
    (C, {"prompt": "x", "stream": True, "stream_options": []}, 400, "invalid_request_error",
     "stream_options"),
    (C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "invalid_request_error", "include_usage"),
    (C, {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     400, "invalid_request_error", "stream_options"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "invalid_request_error", "logprobs"),
    (C, {"prompt": "x", "logprobs": True}, 400, "invalid_request_error", "logprobs"),
    (C, {"prompt": "x", "echo": "yes"}, 400, "invalid_request_error", "echo"),
    (C, {"prompt": "x", "suffix": "tail"}, 400, "invalid_request_error", "suffix"),
    (C, {"prompt": "x", "frequency_penalty": 2.5}, 400, "invalid_request_error",
     "frequency_penalty"),
    (C, {"prompt": "x", "presence_penalty": -3}, 400, "invalid_request_error",
     "presence_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "invalid_request_error",
     "repetition_penalty"),
    (C, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "invalid_request_error", "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "invalid_request_error", "logit_bias"),
    (C, {"prompt": "x", "logit_bias": [5]}, 400, "invalid_request_error", "logit_bias"),
    (C, {"prompt": "x", "min_tokens": -1}, 400, "invalid_request_error", "min_tokens"),
    (C, {"prompt": "x", "min_tokens": True}, 400, "invalid_request_error", "min_tokens"),
    (C, {"prompt": "x", "stop_token_ids": [1, -1]}, 400, "invalid_request_error",
     "stop_token_ids"),
    (C, {"prompt": "x", "guided_choice": []}, 400, "invalid_request_error", "guided_choice"),
    (C, {"prompt": "x", "guided_regex": 5}, 400, "invalid_request_error", "guided_regex"),
    (C, {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "invalid_request_error", "guided_choice"),
    (C, {"prompt": "x", "guided_json": {}, "ignore_eos": True}, 400, "invalid_request_error",
     "ignore_eos"),
    (C, {"prompt": "x", "ignore_eos": "true"}, 400, "invalid_request_error", "ignore_eos"),
    (C, {"prompt": "x", "model": 3}, 400, "invalid_request_error", "model"),
    (C, {"prompt": "x", "priority": "high"}, 400, "invalid_request_error", "priority"),
    (C, {"prompt": "x", "priority": 1.5}, 400, "invalid_request_error", "priority"),
    (C, {"prompt": "x", "priority": True}, 400, "invalid_request_error", "priority"),
    (C, {"prompt": "x", "priority": 2**31}, 400, "invalid_request_error", "priority"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "priority": [1]}, 400,
     "invalid_request_error", "priority"),
    (CHAT, {}, 400, "invalid_request_error", "messages"),
    (CHAT, {"messages": []}, 400, "invalid_request_error", "messages"),
    (CHAT, {"messages": "hi"}, 400, "invalid_request_error", "messages"),
    (CHAT, {"messages": ["hi"]}, 400, "invalid_request_error", "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error",
     "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "invalid_request_error", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error",
     "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                      "image_url": {"url": "x"}}]}]},
     400, "invalid_request_error", "messages"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "invalid_request_error",
     "max_completion_tokens"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "invalid_request_error",
     "tools"),
    (C, {"prompt": "x", "tools": [{"type": "function"}]}, 400, "invalid_request_error",
     "tools"),
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, 400,
     "invalid_request_error", "response_format"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "invalid_request_error", "response_format"),
    (CHAT, {"messages": MSG, "response_format": "json"}, 400, "invalid_request_error",
     "response_format"),
    (CHAT, {"messages": MSG, "n": 200}, 400, "invalid_request_error", "n"),
    (CHAT, {"messages": MSG, "logprobs": 3}, 400, "invalid_request_error", "logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, 400, "invalid_request_error",
     "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400,
     "invalid_request_error", "top_logprobs"),
]


def _parse(endpoint: str, body: dict[str, Any]):
    return parse_chat_request(body) if endpoint == CHAT else parse_completion_request(body)


@pytest.mark.parametrize(("endpoint", "body", "status", "etype", "param"), MALFORMED)
def test_malformed_requests_are_rejected_with_openai_errors(
        endpoint: str, body: dict[str, Any], status: int, etype: str, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        _parse(endpoint, body)
    err = info.value
    assert (err.status, err.type, err.param) == (status, etype, param), err.message
    payload = err.body()["error"]
    assert set(payload) == {"message", "type", "param", "code"}
    assert payload["message"]


@pytest.mark.parametrize(("raw", "fragment"), [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"null", "JSON object"),
    (b"", "not valid JSON"),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
])
def test_unparsable_bodies(raw: bytes, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_json_body(raw)
    assert info.value.status == 400 and fragment in info.value.message


def test_valid_completion_defaults_and_neutral_fields_accepted() -> None:
    req = parse_completion_request({"prompt": "hello", "user": "u1", "best_of": 1,
                                    "frequency_penalty": 0, "logprobs": None,
                                    "logit_bias": {}, "min_tokens": 0, "foo": None})
    assert req.kind == "completion" and req.prompt == "hello"
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k) == (16, 1.0, 1.0, 0)
    assert (req.stream, req.include_usage, req.ignore_eos, req.stop) == (False, False, False, ())


@pytest.mark.parametrize(("endpoint", "field", "value"), [
    (CHAT, "best_of", 2), (CHAT, "echo", True), (C, "top_logprobs", 3),
    (C, "tool_choice", "auto"), (CHAT, "functions", [{"name": "f"}]),
    (C, "best_effort", 3), (C, "parallel_tool_calls", True), (CHAT, "suffix", "x"),
    (C, "prompt_logprobs", 1), (C, "logits_processors", ["x"]),
])
def test_every_field_not_honoured_is_a_400_naming_it(endpoint: str, field: str, value: Any
                                                      ) -> None:
    base = {"prompt": "x"} if endpoint == C else {"messages": MSG}
    with pytest.raises(ApiError) as info:
        _parse(endpoint, {**base, field: value})
    err = info.value
    assert (err.status, err.param, err.code) == (400, field, "unsupported_parameter")
    assert f"'{field}'" in err.message


def test_stop_strings_have_a_length_bound() -> None:
    assert parse_completion_request({"prompt": "x", "stop": "a" * 256}).stop == ("a" * 256,)
    with pytest.raises(ApiError, match="at most 256 characters") as info:
        parse_completion_request({"prompt": "x", "stop": ["ok", "a" * 257]})
    assert info.value.param == "stop"


def test_valid_completion_all_fields() -> None:
    req = parse_completion_request({
        "model": "m", "prompt": [[5, 6, 7]], "max_tokens": 8.0, "temperature": 0,
        "top_p": 0.5, "top_k": -1, "seed": 3, "stop": "END", "stream": True,
        "stream_options": {"include_usage": True}, "n": 1, "ignore_eos": True})
    assert req.prompt_token_ids == (5, 6, 7) and req.prompt is None
    assert (req.max_tokens, req.temperature, req.top_k, req.seed) == (8, 0.0, 0, 3)
    assert req.stop == ("END",) and req.stream and req.include_usage and req.ignore_eos


def test_chat_parts_flatten_and_max_completion_tokens_wins() -> None:
    req = parse_chat_request({
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None}],
        "max_tokens": 5, "max_completion_tokens": 9, "stop": ["x", "x", "y"]})
    assert req.messages[1] == {"role": "user", "content": "a\nb"}
    assert req.messages[2] == {"role": "assistant", "content": ""}
    assert req.max_tokens == 9 and req.stop == ("x", "y")
    assert parse_chat_request({"messages": MSG}).max_tokens is None  # fill the context


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


def test_context_length_error_names_both_numbers(tok: PreTrainedTokenizerFast) -> None:
    req = parse_completion_request({"prompt": "the lazy dog", "max_tokens": 60})
    ids = encode_prompt(req, tok)
    with pytest.raises(ApiError) as info:
        build_sampling_params(req, len(ids), 64, [0])
    err = info.value
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert str(len(ids)) in err.message and "60" in err.message and "64" in err.message
    params = build_sampling_params(req, len(ids), len(ids) + 60, [0])
    assert params.max_tokens == 60 and params.stop_token_ids == (0,)


def test_prompt_longer_than_context_is_rejected_for_chat(tok: PreTrainedTokenizerFast) -> None:
    req = parse_chat_request({"messages": MSG})
    ids = encode_prompt(req, tok)
    with pytest.raises(ApiError, match=f"{len(ids)} tokens"):
        build_sampling_params(req, len(ids), len(ids), [0])
    # Default chat budget: whatever is left of the context.
    assert build_sampling_params(req, len(ids), 100, [0]).max_tokens == 100 - len(ids)


def test_chat_template_is_applied_with_generation_prompt(tok: PreTrainedTokenizerFast) -> None:
    ids = encode_prompt(parse_chat_request({"messages": MSG}), tok)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_temperature_is_greedy() -> None:
    req = parse_completion_request({"prompt": "x", "temperature": 1e-9})
    assert build_sampling_params(req, 1, 64, [0]).temperature == 0.0


def test_ignore_eos_passes_no_stop_token_ids(tok: PreTrainedTokenizerFast) -> None:
    req = parse_completion_request({"prompt": "x", "ignore_eos": True, "temperature": 0})
    params = build_sampling_params(req, 1, 64, [0, 2])
    assert params.ignore_eos and params.stop_token_ids == () and params.greedy


def test_token_id_prompt_out_of_vocab(tok: PreTrainedTokenizerFast) -> None:
    req = parse_completion_request({"prompt": [1, len(tok)]})
    with pytest.raises(ApiError, match="out of range") as info:
        encode_prompt(req, tok)
    assert info.value.status == 400 and info.value.param == "prompt"


def test_token_id_between_model_and_tokenizer_vocab_is_a_400(tok: PreTrainedTokenizerFast
                                                              ) -> None:
    # The model's embedding has fewer rows than the tokenizer has tokens: an id in between
    # would index past the embedding inside the engine.
    model_vocab = len(tok) - 4
    assert encode_prompt(parse_completion_request({"prompt": [model_vocab - 1]}), tok,
                         model_vocab) == [model_vocab - 1]
    with pytest.raises(ApiError, match=f"id {model_vocab} is out of range") as info:
        encode_prompt(parse_completion_request({"prompt": [1, model_vocab]}), tok, model_vocab)
    assert info.value.status == 400 and str(model_vocab) in info.value.message


def test_missing_chat_template_is_a_400() -> None:
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ApiError, match="no chat template") as info:
        encode_prompt(parse_chat_request({"messages": MSG}), tok)
    assert info.value.status == 400


def test_template_exception_is_a_400() -> None:
    tok = build_tiny_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ApiError, match="roles must alternate") as info:
        encode_prompt(parse_chat_request({"messages": MSG}), tok)
    assert info.value.status == 400


def test_every_honoured_field_reaches_the_request() -> None:
    req = parse_completion_request({
        "prompt": ["a b", [5, 6]], "n": 2, "best_of": 3, "logprobs": 4, "echo": True,
        "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.3,
        "logit_bias": {"7": -100, "9": 2.5}, "min_tokens": 3, "stop_token_ids": [4, 4, 2],
        "seed": 11, "max_tokens": 0})
    assert req.prompts == ("a b", (5, 6)) and req.prompt == "a b"
    assert (req.n, req.best_of, req.logprobs, req.echo, req.max_tokens) == (2, 3, 4, True, 0)
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (
        0.5, -0.25, 1.3)
    assert req.logit_bias == ((7, -100.0), (9, 2.5)) and req.min_tokens == 3
    assert req.stop_token_ids == (4, 2) and req.seed == 11


def test_chat_logprobs_and_structured_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_chat_request({"messages": MSG, "logprobs": True, "top_logprobs": 5,
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": schema, "strict": True}}})
    assert req.logprobs == 5 and req.guided is not None
    assert req.guided.kind == "json_schema" and req.guided_param == "response_format"
    assert parse_chat_request({"messages": MSG, "logprobs": True}).logprobs == 0
    assert parse_chat_request({"messages": MSG, "logprobs": False}).logprobs is None
    req = parse_chat_request({"messages": MSG, "response_format": {"type": "json_object"}})
    assert req.guided is not None and req.guided.kind == "json_object"
    assert parse_chat_request({"messages": MSG,
                               "response_format": {"type": "text"}}).guided is None
    req = parse_chat_request({"messages": MSG, "guided_choice": ["yes", "no"]})
    assert req.guided is not None and req.guided.kind == "choice"
    assert req.guided_param == "guided_choice"
    req = parse_completion_request({"prompt": "x", "guided_regex": "[0-9]+"})
    assert req.guided is not None and (req.guided.kind, req.guided.value) == ("regex", "[0-9]+")


def test_sampling_params_carry_every_field(tok: PreTrainedTokenizerFast) -> None:
    req = parse_completion_request({
        "prompt": "x", "n": 2, "best_of": 3, "logprobs": 2, "echo": True, "max_tokens": 5,
        "presence_penalty": 0.5, "logit_bias": {"7": 1}, "min_tokens": 2,
        "stop_token_ids": [9], "repetition_penalty": 1.1})
    p = build_sampling_params(req, 3, 64, [0], vocab=len(tok))
    assert (p.n, p.best_of, p.num_sequences, p.logprobs, p.prompt_logprobs) == (2, 3, 3, 2, 2)
    assert p.stop_token_ids == (0, 9) and p.logit_bias == ((7, 1.0),) and p.min_tokens == 2
    assert (p.presence_penalty, p.repetition_penalty) == (0.5, 1.1)


def test_priority_reaches_the_sampling_params(tok: PreTrainedTokenizerFast) -> None:
    for body, want in (({}, 0), ({"priority": None}, 0), ({"priority": -3}, -3),
                       ({"priority": 7.0}, 7)):
        req = parse_completion_request({"prompt": "x", **body})
        assert build_sampling_params(req, 3, 64, [0], vocab=len(tok)).priority == want
    chat = parse_chat_request({"messages": MSG, "priority": 2})
    assert build_sampling_params(chat, 3, 64, [0], vocab=len(tok)).priority == 2


def test_max_tokens_zero_is_only_for_echo_and_runs_one_step() -> None:
    with pytest.raises(ApiError) as info:
        parse_completion_request({"prompt": "x", "max_tokens": 0})
    assert info.value.param == "max_tokens"
    req = parse_completion_request({"prompt": "x", "max_tokens": 0, "echo": True,
                                    "logprobs": 1})
    p = build_sampling_params(req, 3, 64, [0])
    assert p.max_tokens == 1 and p.logprobs is None and p.prompt_logprobs == 1


@pytest.mark.parametrize(("field", "value"), [("logit_bias", {"400": 1}),
                                               ("stop_token_ids", [1, 400])])
def test_token_ids_in_fields_are_checked_against_the_vocabulary(field: str, value: Any) -> None:
    req = parse_completion_request({"prompt": "x", field: value})
    with pytest.raises(ApiError, match="400") as info:
        build_sampling_params(req, 1, 64, [0], vocab=320)
    assert info.value.param == field


def test_min_tokens_above_max_tokens_is_a_400() -> None:
    req = parse_completion_request({"prompt": "x", "min_tokens": 9, "max_tokens": 4})
    with pytest.raises(ApiError) as info:
        build_sampling_params(req, 1, 64, [0])
    assert info.value.param == "min_tokens"
