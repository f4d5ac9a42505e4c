"""OpenAI request parsing and validation: JSON body -> `GenerationRequest`, or `ApiError`.

Pure functions (no I/O, no event loop) so the whole validation table is unit-testable.
A field with a wrong type or value is a 400 naming the parameter. So is every field this
server does not honour (as OpenAI answers "Unrecognized request argument"): a client that
relies on logprobs, penalties, logit_bias, tools or structured output would otherwise get
wrong results without noticing. A feature's neutral value (n=1, logprobs=false, a zero
penalty, ...) and null are accepted, since they ask for nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # per stop string: the matcher holds back this much text per request
MAX_SEED = 2**63 - 1
# Fields each endpoint honours (null is always accepted as "absent").
_SAMPLING = frozenset({"model", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                       "stream_options", "ignore_eos", "n", "presence_penalty",
                       "frequency_penalty", "logprobs", "response_format", "tools",
                       "user"})  # user: an end-user id for abuse tracing; no effect on output
COMPLETION_FIELDS = _SAMPLING | {"prompt", "max_tokens", "echo", "suffix"}
CHAT_FIELDS = _SAMPLING | {"messages", "max_tokens", "max_completion_tokens"}
# Fields not honoured, accepted only with the value that asks for nothing.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "best_of": (1,), "min_tokens": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "top_logprobs": (0,), "tool_choice": ("none",), "functions": ([],),
}
_ROLES = ("system", "developer", "user", "assistant", "tool")
_DEFAULT_TYPE = {
    400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
    413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _DEFAULT_TYPE.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One validated completion or chat request, before tokenization."""

    kind: Literal["completion", "chat"]
    model: str | None
    prompt: str | None = None  # completion, text prompt
    prompt_token_ids: tuple[int, ...] | None = None  # completion, pre-tokenized prompt
    messages: tuple[dict[str, str], ...] = ()  # chat, content flattened to text
    max_tokens: int | None = 16  # None: as many as fit in max_seq_len (chat default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(None, f"request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:  # e.g. 100k nested arrays: the C scanner gives up
        raise _bad(None, "request body is nested too deeply", "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(None, f"request body must be a JSON object, got {_tname(body)}",
                   "invalid_type")
    return body


def _tname(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _opt_int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # some clients serialize 16 as 16.0
    if not _is_int(v):
        raise _bad(name, f"'{name}' must be an integer, got {_tname(v)}", "invalid_type")
    return v


def _opt_num(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise _bad(name, f"'{name}' must be a finite number, got {_tname(v)}", "invalid_type")
    return float(v)


def _opt_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {_tname(v)}", "invalid_type")
    return v


def _model(body: dict[str, Any]) -> str | None:
    v = body.get("model")
    if v is not None and not isinstance(v, str):
        raise _bad("model", f"'model' must be a string, got {_tname(v)}", "invalid_type")
    return v


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "'stop' must be a string or an array of strings", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} "
                   "are allowed")
    if any(s == "" for s in stops):
        raise _bad("stop", "'stop' strings must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad("stop", f"'stop' strings may be at most {MAX_STOP_CHARS} characters long")
    return tuple(dict.fromkeys(stops))  # de-duplicated, order kept


def _refuse_unhonoured(body: dict[str, Any], honoured: frozenset[str]) -> None:
    for name, value in body.items():
        if name in honoured or value is None:
            continue
        if name in _NEUTRAL and value in _NEUTRAL[name] and type(value) is not bool:
            continue
        raise _bad(name, f"'{name}' is not supported by this server; remove it",
                   "unsupported_parameter")


def _unsupported(body: dict[str, Any]) -> None:
    n = _opt_int(body, "n", 1)
    if n != 1:
        raise _bad("n", f"'n' must be 1 (only one choice per request is supported), got {n}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _opt_num(body, name, 0.0)
        if value != 0.0:
            raise _bad(name, f"'{name}' is not supported (must be 0 or absent)")
    if body.get("logprobs") not in (None, False):
        raise _bad("logprobs", "'logprobs' is not supported")
    if body.get("echo") not in (None, False):
        raise _bad("echo", "'echo' is not supported")
    if body.get("tools"):
        raise _bad("tools", "'tools' is not supported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format", "only response_format {\"type\": \"text\"} is supported")


def _sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    temperature = _opt_num(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise _bad("temperature", f"'temperature' must be in [0, 2], got {temperature}")
    top_p = _opt_num(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _bad("top_p", f"'top_p' must be in (0, 1], got {top_p}")
    top_k = _opt_int(body, "top_k", 0)
    assert top_k is not None
    if top_k == -1:
        top_k = 0  # vLLM's spelling of "disabled"
    if top_k < 0:
        raise _bad("top_k", f"'top_k' must be >= 0 (0 or -1 disables it), got {top_k}")
    seed = _opt_int(body, "seed", None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise _bad("seed", f"'seed' must be in [0, 2^63-1], got {seed}")
    stream = _opt_bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options", "'stream_options' must be an object", "invalid_type")
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        include_usage = _opt_bool(opts, "include_usage", False)
    _unsupported(body)
    return {"model": _model(body), "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "seed": seed, "stop": _stop(body), "stream": stream, "include_usage": include_usage,
            "ignore_eos": _opt_bool(body, "ignore_eos", False)}


def _check_max_tokens(name: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise _bad(name, f"'{name}' must be at least 1, got {value}")
    return value


def parse_completion_request(body: dict[str, Any]) -> GenerationRequest:
    """Validate a POST /v1/completions body."""
    _refuse_unhonoured(body, COMPLETION_FIELDS)
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt", "'prompt' is required", "missing_required_parameter")
    prompt: object = body["prompt"]
    # A one-element batch is the same request; several prompts are a batch we refuse.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise _bad("prompt", f"'prompt' holds {len(prompt)} prompts; send one prompt "
                       "per request")
        prompt = prompt[0]
    text: str | None = None
    ids: tuple[int, ...] | None = None
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "'prompt' must not be empty")
        text = prompt
    elif isinstance(prompt, list):
        if not prompt:
            raise _bad("prompt", "'prompt' must not be empty")
        if not all(_is_int(t) and t >= 0 for t in prompt):
            raise _bad("prompt", "a token-id 'prompt' must be an array of non-negative "
                       "integers", "invalid_type")
        ids = tuple(prompt)
    else:
        raise _bad("prompt", "'prompt' must be a string or an array of token ids, got "
                   f"{_tname(prompt)}", "invalid_type")
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix", "'suffix' is not supported")
    max_tokens = _check_max_tokens("max_tokens", _opt_int(body, "max_tokens", 16))
    return GenerationRequest(kind="completion", prompt=text, prompt_token_ids=ids,
                             max_tokens=max_tokens, **_sampling_fields(body))


def _message_text(i: int, msg: dict[str, Any]) -> str:
    content = msg.get("content")
    if content is None:
        if msg.get("role") == "assistant":
            return ""
        raise _bad("messages", f"messages[{i}].content is required")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else _tname(part)
                raise _bad("messages", f"messages[{i}].content part of type {kind!r} is not "
                           "supported (text only)")
            if not isinstance(part.get("text"), str):
                raise _bad("messages", f"messages[{i}].content text part needs a string "
                           "'text'", "invalid_type")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad("messages", f"messages[{i}].content must be a string or an array of text "
               f"parts, got {_tname(content)}", "invalid_type")


def parse_chat_request(body: dict[str, Any]) -> GenerationRequest:
    """Validate a POST /v1/chat/completions body."""
    _refuse_unhonoured(body, CHAT_FIELDS)
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _bad("messages", f"'messages' must be an array, got {_tname(messages)}",
                   "invalid_type")
    if not messages:
        raise _bad("messages", "'messages' must not be empty")
    flat: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad("messages", f"messages[{i}] must be an object", "invalid_type")
        role = msg.get("role")
        if role not in _ROLES:
            raise _bad("messages", f"messages[{i}].role must be one of {', '.join(_ROLES)}, "
                       f"got {role!r}")
        flat.append({"role": role, "content": _message_text(i, msg)})
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _check_max_tokens(name, _opt_int(body, name, None))
    return GenerationRequest(kind="chat", messages=tuple(flat), max_tokens=max_tokens,
                             **_sampling_fields(body))
