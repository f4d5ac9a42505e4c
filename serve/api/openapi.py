"""The OpenAPI 3.1 description of the HTTP API, served at GET /openapi.json.

Written by hand from serve/api/protocol.py (which stays the authority: a request this
schema admits may still be refused with a 400, e.g. a prompt longer than the context),
and checked against the live server by a schemathesis run in the tests.
"""

from __future__ import annotations

from typing import Any

from runtime.core.types import MAX_LOGPROBS, PRIORITY_RANGE
from serve.api.params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_SCHEMA_CHARS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from serve.api.protocol import MAX_PROMPTS
from serve.api.state import ServerState
from serve.api.tools import MAX_TOOLS

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_STOP = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                   {"type": "array", "maxItems": MAX_STOP_STRINGS,
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                   {"type": "null"}]}
_TOP = {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS}
_SCHEMA_TEXT = {"type": "string", "minLength": 1, "maxLength": MAX_SCHEMA_CHARS}
_RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text"]}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"enum": ["json_schema"]},
        "json_schema": {"type": "object", "properties": {
            "name": {"type": "string"}, "description": {"type": "string"},
            "strict": {"type": ["boolean", "null"]},
            "schema": {"type": ["object", "boolean"]}}}}},
    {"type": "null"}]}
_SAMPLING: dict[str, Any] = {
    "model": {"type": ["string", "null"]},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_SEED},
    "stop": _STOP,
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                       "properties": {"include_usage": {"type": ["boolean", "null"]}}},
    "ignore_eos": {"type": ["boolean", "null"], "description": "vLLM's extension"},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N,
          "description": "choices per prompt; the prompt is prefilled once and its KV "
                         "blocks are shared"},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 100,
                           "description": "vLLM's extension: on prompt and output tokens"},
    "logit_bias": {"type": ["object", "null"], "maxProperties": MAX_LOGIT_BIAS,
                   "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                   "additionalProperties": {"type": "number", "minimum": -100,
                                            "maximum": 100}},
    "min_tokens": {"type": ["integer", "null"], "minimum": 0},
    "stop_token_ids": {"type": ["array", "null"], "maxItems": MAX_STOP_TOKEN_IDS,
                       "items": {"type": "integer", "minimum": 0}},
    "response_format": _RESPONSE_FORMAT,
    "guided_json": {"anyOf": [{"type": "object"}, _SCHEMA_TEXT, {"type": "null"}],
                    "description": "vLLM's extension: a JSON Schema"},
    "guided_regex": {"anyOf": [_SCHEMA_TEXT, {"type": "null"}]},
    "guided_choice": {"type": ["array", "null"], "minItems": 1,
                      "items": {"type": "string", "minLength": 1}},
    "guided_grammar": {"anyOf": [_SCHEMA_TEXT, {"type": "null"}],
                       "description": "EBNF (xgrammar's dialect)"},
    "priority": {"type": ["integer", "null"], "minimum": PRIORITY_RANGE[0],
                 "maximum": PRIORITY_RANGE[1],
                 "description": "vLLM's extension: lower is scheduled earlier (default 0)"},
    "user": {"type": ["string", "null"]},
}
_TOKENS = {"type": ["integer", "null"], "minimum": 1}
_COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"], "additionalProperties": False,
    "properties": {**_SAMPLING,
                   "max_tokens": {"type": ["integer", "null"], "minimum": 0,
                                  "description": "0 only with echo: the prompt's "
                                                 "log-probabilities alone"},
                   "prompt": {"anyOf": [
                       {"type": "string", "minLength": 1},
                       {"type": "array", "minItems": 1,
                        "items": {"type": "integer", "minimum": 0}},
                       {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                        "items": {"type": "string", "minLength": 1}},
                       {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                        "items": {"type": "array", "minItems": 1,
                                  "items": {"type": "integer", "minimum": 0}}}]},
                   "logprobs": _TOP, "echo": {"type": ["boolean", "null"]},
                   "best_of": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N},
                   "suffix": {"enum": ["", None]}}}
# Chat messages (serve/api/protocol.py, tools.py's parse_message): text content, or text
# parts; an assistant's may be null beside its tool calls; a tool result names its call.
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}}]}
_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"},
        "arguments": {"type": ["string", "object"],
                      "description": "the arguments as JSON text (an object is accepted "
                                     "too); default {}"}}}}}
_MESSAGE = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT}},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["assistant"]},
        "content": {"anyOf": [*_CONTENT["anyOf"], {"type": "null"}]},
        "tool_calls": {"type": "array", "items": _CALL}}},
    {"type": "object", "required": ["role", "content", "tool_call_id"], "properties": {
        "role": {"enum": ["tool"]}, "content": _CONTENT,
        "tool_call_id": {"type": "string"}, "name": {"type": "string"}}}]}
_TOOL = {"type": "object", "required": ["function"], "properties": {
    "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                 "properties": {
                     "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                     "description": {"type": ["string", "null"]},
                     "parameters": {"type": ["object", "null"],
                                    "properties": {"type": {"enum": ["object"]}},
                                    "description": "a JSON Schema of the arguments object "
                                                   "(default: any object)"},
                     "strict": {"type": ["boolean", "null"]}}}}}
_CHAT_REQUEST = {
    "type": "object", "required": ["messages"], "additionalProperties": False,
    "properties": {**_SAMPLING, "max_tokens": _TOKENS, "max_completion_tokens": _TOKENS,
                   "logprobs": {"type": ["boolean", "null"]}, "top_logprobs": _TOP,
                   "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                   "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": _TOOL,
                             "description": "function tools; tool_choice other than none and "
                                            "auto needs at least one"},
                   "tool_choice": {"anyOf": [
                       {"enum": ["none", "auto", "required", None]},
                       {"type": "object", "required": ["type", "function"], "properties": {
                           "type": {"enum": ["function"]},
                           "function": {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"}}}}}]},
                   "parallel_tool_calls": {"type": ["boolean", "null"]}}}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
_RESPONSES_REQUEST = {
    "type": "object", "required": ["input"], "additionalProperties": False,
    "description": "OpenAI's Responses API, stateless: run as a chat completion",
    "properties": {
        "model": _SAMPLING["model"], "temperature": _SAMPLING["temperature"],
        "top_p": _SAMPLING["top_p"], "stream": _SAMPLING["stream"], "user": _SAMPLING["user"],
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {
            "anyOf": [
                {"type": "object", "required": ["role", "content"], "properties": {
                    "type": {"enum": ["message"]},
                    "role": {"enum": ["user", "assistant", "system", "developer"]},
                    "content": {"anyOf": [{"type": "string"},
                                          {"type": "array", "items": _TEXT_PART}]}}},
                {"type": "object", "required": ["type", "call_id", "name", "arguments"],
                 "properties": {"type": {"enum": ["function_call"]},
                                "call_id": {"type": "string", "minLength": 1},
                                "name": {"type": "string", "minLength": 1},
                                "arguments": {"type": "string"}}},
                {"type": "object", "required": ["type", "call_id", "output"],
                 "properties": {"type": {"enum": ["function_call_output"]},
                                "call_id": {"type": "string", "minLength": 1},
                                "output": {"type": "string"}}}]}}]},
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": _TOKENS,
        "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                           "properties": {"include_obfuscation": {"type": "boolean"}}},
        "tools": {"type": ["array", "null"], "items": {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"enum": ["function"]}, "name": {"type": "string", "minLength": 1},
                "description": {"type": ["string", "null"]},
                "parameters": {"type": ["object", "null"]},
                "strict": {"type": ["boolean", "null"]}}}},
        "tool_choice": {"anyOf": [
            {"enum": ["none", "auto", "required", None]},
            {"type": "object", "required": ["type", "name"], "properties": {
                "type": {"enum": ["function"]}, "name": {"type": "string"}}}]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "text": {"type": ["object", "null"], "properties": {"format": {"anyOf": [
            {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "schema"], "properties": {
                "type": {"enum": ["json_schema"]}, "name": {"type": "string"},
                "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}]}}},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
        "store": {"enum": [False, None],
                  "description": "nothing is stored: true is a 400 (so is previous_response_id)"},
        "safety_identifier": {"type": ["string", "null"]},
        "prompt_cache_key": {"type": ["string", "null"]}}}
_TOKENIZE_REQUEST = {
    "type": "object", "additionalProperties": False,
    "description": "vLLM's /tokenize: a prompt, or chat messages through the chat template",
    "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
    "properties": {"model": _SAMPLING["model"], "prompt": {"type": "string"},
                   "messages": _CHAT_REQUEST["properties"]["messages"],
                   "add_special_tokens": {"type": ["boolean", "null"]},
                   "add_generation_prompt": {"type": ["boolean", "null"]},
                   "return_token_strs": {"type": ["boolean", "null"]}}}
_DETOKENIZE_REQUEST = {
    "type": "object", "required": ["tokens"], "additionalProperties": False,
    "properties": {"model": _SAMPLING["model"],
                   "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}
_USAGE = {"type": "object", "properties": {
    **{k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
    "prompt_tokens_details": {"type": "object", "properties": {
        "cached_tokens": {"type": "integer",
                          "description": "prompt tokens served by the prefix cache"}}}}}
_COMPLETION = {"type": "object", "required": ["id", "object", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "choices": {"type": "array"}, "usage": _USAGE}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "an OpenAI-style error", "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}} for c in codes}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _generate(request: str, summary: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {"200": {"description": "the completion (JSON), or with stream: true "
                              "a text/event-stream of chunks ending in data: [DONE]",
                              "content": {"application/json": {"schema": _COMPLETION},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **_errors(400, 401, 404, 413, 429, 500, 503)}}}


def _post(request: str, summary: str, answer: dict[str, Any], stream: bool = False
          ) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": answer}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {"200": {"description": "OK", "content": content},
                      **_errors(400, 401, 404, 413, 429, 500, 503)}}}


_RESPONSE = {"type": "object", "required": ["id", "object", "output"], "properties": {
    "id": {"type": "string"}, "object": {"enum": ["response"]}, "output": {"type": "array"}}}
_TOKENS_OUT = {"type": "object", "required": ["count", "max_model_len", "tokens"],
               "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                              "tokens": {"type": "array", "items": {"type": "integer"}},
                              "token_strs": {"type": ["array", "null"]}}}
_TEXT_OUT = {"type": "object", "required": ["prompt"],
             "properties": {"prompt": {"type": "string"}}}


def openapi_spec(state: ServerState) -> dict[str, Any]:
    get_json = {"get": {"responses": {"200": _json({"type": "object"}), **_errors(401, 404)}}}
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "aot-llm serve", "version": "1",
                 "description": f"OpenAI-compatible endpoint serving {state.model_name}"},
        "paths": {
            "/v1/completions": _generate("CompletionRequest", "text completion"),
            "/v1/chat/completions": _generate("ChatRequest", "chat completion"),
            "/v1/responses": _post("ResponsesRequest", "OpenAI Responses API (stateless)",
                                   _RESPONSE, stream=True),
            "/tokenize": _post("TokenizeRequest", "text or messages -> token ids",
                               _TOKENS_OUT),
            "/detokenize": _post("DetokenizeRequest", "token ids -> text", _TEXT_OUT),
            "/v1/models": get_json,
            "/v1/models/{model}": {"get": {
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": _json({"type": "object"}), **_errors(401, 404)}}},
            "/v1/engine": get_json,
            "/health/live": {"get": {"responses": {"200": _json({"type": "object"}),
                                                   "503": _json({"type": "object"}, "failed")}}},
            "/health/ready": {"get": {"responses": {
                "200": _json({"type": "object"}), "503": _json({"type": "object"}, "not ready")}}},
            "/metrics": {"get": {"responses": {"200": {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": {"Error": _ERROR, "CompletionRequest": _COMPLETION_REQUEST,
                                   "ChatRequest": _CHAT_REQUEST,
                                   "ResponsesRequest": _RESPONSES_REQUEST,
                                   "TokenizeRequest": _TOKENIZE_REQUEST,
                                   "DetokenizeRequest": _DETOKENIZE_REQUEST}},
    }
    if state.api_key is not None:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in spec["paths"].items():
            if path.startswith(("/v1/", "/tokenize", "/detokenize")):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return spec
