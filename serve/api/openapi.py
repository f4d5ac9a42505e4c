"""The OpenAPI 3.1 description of the HTTP API, served at GET /openapi.json.

Written by hand from serve/api/protocol.py (which stays the authority: a request this
schema admits may still be refused with a 400, e.g. a prompt longer than the context),
and checked against the live server by a schemathesis run in the tests.
"""

from __future__ import annotations

from typing import Any

from serve.api.protocol import MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS
from serve.api.state import ServerState

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_STOP = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                   {"type": "array", "maxItems": MAX_STOP_STRINGS,
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                   {"type": "null"}]}
_SAMPLING: dict[str, Any] = {
    "model": {"type": ["string", "null"]},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_SEED},
    "stop": _STOP,
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"],
                       "properties": {"include_usage": {"type": "boolean"}}},
    "ignore_eos": {"type": ["boolean", "null"], "description": "vLLM's extension"},
    "n": {"type": ["integer", "null"], "enum": [1, None]},
    "presence_penalty": {"type": ["number", "null"], "enum": [0, None]},
    "frequency_penalty": {"type": ["number", "null"], "enum": [0, None]},
    "logprobs": {"enum": [False, None]},
    "user": {"type": ["string", "null"]},
}
_TOKENS = {"type": ["integer", "null"], "minimum": 1}
_COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"], "additionalProperties": False,
    "properties": {**_SAMPLING, "max_tokens": _TOKENS,
                   "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                        {"type": "array", "minItems": 1,
                                         "items": {"type": "integer", "minimum": 0}}]},
                   "echo": {"enum": [False, None]}, "suffix": {"enum": ["", None]}}}
_CHAT_REQUEST = {
    "type": "object", "required": ["messages"], "additionalProperties": False,
    "properties": {**_SAMPLING, "max_tokens": _TOKENS, "max_completion_tokens": _TOKENS,
                   "messages": {"type": "array", "minItems": 1, "items": {
                       "type": "object", "required": ["role", "content"],
                       "properties": {"role": {"enum": ["system", "developer", "user",
                                                        "assistant", "tool"]},
                                      "content": {"type": "string"}}}}}}
_USAGE = {"type": "object", "properties": {k: {"type": "integer"} for k in (
    "prompt_tokens", "completion_tokens", "total_tokens")}}
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
