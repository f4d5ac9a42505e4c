"""The OpenAPI 3.1 description of the HTTP API, served at GET /openapi.json.

Written by hand from serve/api/protocol.py (which stays the authority: a request this
schema admits may still be refused with a 400, e.g. a prompt longer than the context),
and checked against the live server by a schemathesis run in the tests.
"""

from __future__ import annotations

from typing import Any

from runtime.types import MAX_LOGPROBS, PRIORITY_RANGE
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
_CHAT_REQUEST = {
    "type": "object", "required": ["messages"], "additionalProperties": False,
    "properties": {**_SAMPLING, "max_tokens": _TOKENS, "max_completion_tokens": _TOKENS,
                   "logprobs": {"type": ["boolean", "null"]}, "top_logprobs": _TOP,
                   "messages": {"type": "array", "minItems": 1, "items": {
                       "type": "object", "required": ["role", "content"],
                       "properties": {"role": {"enum": ["system", "developer", "user",
                                                        "assistant", "tool"]},
                                      "content": {"type": "string"}}}}}}
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


def openapi_spec(state: ServerState) -> dict[str, Any]:
    get_json = {"get": {"responses": {"200": _json({"type": "object"}), **_errors(401, 404)}}}
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "aot-llm serve", "version": "1",
                 "description": f"OpenAI-compatible endpoint serving {state.model_name}"},
        "paths": {
            "/v1/completions": _generate("CompletionRequest", "text completion"),
            "/v1/chat/completions": _generate("ChatRequest", "chat completion"),
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
                                   "ChatRequest": _CHAT_REQUEST}},
    }
    if state.api_key is not None:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in spec["paths"].items():
            if path.startswith("/v1/"):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return spec
