"""OpenAI request parsing and validation: JSON body -> `GenerationRequest`, or `ApiError`.

Pure functions (no I/O, no event loop) so the whole validation table is unit-testable.
A field with a wrong type or value is a 400 naming the parameter. So is every field this
server does not honour (as OpenAI answers "Unrecognized request argument"): a client that
relies on a field it does not honour (the legacy `functions`, say) would otherwise get wrong
results without noticing. Such a field's neutral value (an empty functions list) and null are
accepted, since they ask for nothing. Tool calling (`tools`, `tool_choice`) is in tools.py. The sampling and output fields are in params.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from runtime.core.types import GuidedSpec
from serve.api.fields import ApiError, bad, is_int, opt_int, tname
from serve.api.params import (
    GUIDED_FIELDS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    sampling_fields,
)
from serve.api.tools import ToolSpec, parse_message, parse_tools

__all__ = ["MAX_PROMPTS", "MAX_SEED", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "ApiError",
           "GenerationRequest", "parse_chat_request", "parse_completion_request",
           "parse_json_body"]

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
# Fields each endpoint honours (null is always accepted as "absent").
_SAMPLING = frozenset({"model", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                       "stream_options", "ignore_eos", "n", "presence_penalty",
                       "frequency_penalty", "repetition_penalty", "logit_bias",
                       "min_tokens", "stop_token_ids", "logprobs", "response_format",
                       "tools", *GUIDED_FIELDS,
                       "priority",  # vLLM's: lower is scheduled earlier
                       "user"})  # user: an end-user id for abuse tracing; no effect on output
COMPLETION_FIELDS = _SAMPLING | {"prompt", "max_tokens", "echo", "suffix", "best_of"}
CHAT_FIELDS = _SAMPLING | {"messages", "max_tokens", "max_completion_tokens", "top_logprobs",
                           "tool_choice", "parallel_tool_calls"}  # tools.py
# Fields not honoured, accepted only with the value that asks for nothing.
_NEUTRAL: dict[str, tuple[object, ...]] = {"tool_choice": ("none",), "functions": ([],)}
_ROLES = ("system", "developer", "user", "assistant", "tool")
_bad = bad  # the name the parsers below use


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One validated completion or chat request, before tokenization."""

    kind: Literal["completion", "chat"]
    model: str | None
    # completion: one prompt or a batch, each text or token ids
    prompts: tuple[str | tuple[int, ...], ...] = ()
    messages: tuple[dict[str, Any], ...] = ()  # chat, content flattened to text
    max_tokens: int | None = 16  # None: as many as fit in max_seq_len (chat default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None  # completions: sequences generated per prompt, n best kept
    logprobs: int | None = None  # top alternatives per token; None: no log-probabilities
    echo: bool = False  # completions: the prompt (and its log-probabilities) comes back
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    guided: GuidedSpec | None = None
    guided_param: str | None = None  # the field it came from (response_format, guided_*)
    tools: ToolSpec | None = None  # chat tool calling (tools.py); None: no tools in play
    priority: int = 0  # scheduling: lower first (vLLM's convention)

    @property
    def prompt(self) -> str | None:
        """The first prompt when it is text (a batch's first)."""
        first = self.prompts[0] if self.prompts else None
        return first if isinstance(first, str) else None

    @property
    def prompt_token_ids(self) -> tuple[int, ...] | None:
        first = self.prompts[0] if self.prompts else None
        return first if isinstance(first, tuple) else None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(None, f"request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:  # e.g. 100k nested arrays: the C scanner gives up
        raise _bad(None, "request body is nested too deeply", "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(None, f"request body must be a JSON object, got {tname(body)}",
                   "invalid_type")
    return body


def _encodable(text: str) -> int | None:
    """None when `text` encodes as UTF-8, else the index of its first lone surrogate."""
    if text.isascii():
        return None
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _check_text(body: dict[str, Any]) -> None:
    """Every string in the body (names too) must be encodable text. JSON's \\ud800 escape
    parses to a lone surrogate, which no tokenizer, template or UTF-8 writer accepts (the
    prompt was a 500 from deep in the tokenizer): a 400 naming the field, on every path."""
    if any(_encodable(name) is not None for name in body):
        raise _bad(None, "a field name is not valid Unicode text (a lone surrogate)",
                   "invalid_text")
    todo: list[tuple[str, str, Any]] = [(name, name, value) for name, value in body.items()]
    while todo:  # iterative: the body may nest as deep as the JSON parser allowed
        field, path, value = todo.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                # The path goes into the error message: escape what cannot be encoded.
                todo.append((field, f"{path}.{k.encode(errors='backslashreplace').decode()}",
                             v))
                todo.append((field, f"{path} (a name)", k))
        elif isinstance(value, list):
            todo.extend((field, f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, str) and (at := _encodable(value)) is not None:
            raise _bad(field, f"'{path}' is not valid Unicode text: a lone surrogate "
                       f"(\\u{ord(value[at]):04x}) at character {at}", "invalid_text")


def _refuse_unhonoured(body: dict[str, Any], honoured: frozenset[str]) -> None:
    for name, value in body.items():
        if name in honoured or value is None:
            continue
        if name in _NEUTRAL and value in _NEUTRAL[name] and type(value) is not bool:
            continue
        raise _bad(name, f"'{name}' is not supported by this server; remove it",
                   "unsupported_parameter")


def _check_max_tokens(name: str, value: int | None, minimum: int = 1) -> int | None:
    if value is not None and value < minimum:
        raise _bad(name, f"'{name}' must be at least {minimum}, got {value}")
    return value


def _one_prompt(prompt: object) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "'prompt' must not be empty")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("prompt", "'prompt' must not be empty")
        if not all(is_int(t) and t >= 0 for t in prompt):
            raise _bad("prompt", "a token-id 'prompt' must be an array of non-negative "
                       "integers", "invalid_type")
        return tuple(prompt)
    raise _bad("prompt", "'prompt' must be a string or an array of token ids, got "
               f"{tname(prompt)}", "invalid_type")


def _prompts(prompt: object) -> tuple[str | tuple[int, ...], ...]:
    """A string, a token-id array, or a batch (array) of either."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_PROMPTS:
            raise _bad("prompt", f"'prompt' holds {len(prompt)} prompts; at most "
                       f"{MAX_PROMPTS} are allowed per request")
        return tuple(_one_prompt(p) for p in prompt)
    return (_one_prompt(prompt),)


def parse_completion_request(body: dict[str, Any]) -> GenerationRequest:
    """Validate a POST /v1/completions body."""
    _check_text(body)
    _refuse_unhonoured(body, COMPLETION_FIELDS)
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt", "'prompt' is required", "missing_required_parameter")
    prompts = _prompts(body["prompt"])
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix", "'suffix' is not supported (no fill-in-the-middle)",
                   "unsupported_parameter")
    fields = sampling_fields(body, "completion")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise _bad("echo", f"'echo' must be a boolean, got {tname(echo)}", "invalid_type")
    # max_tokens 0 asks for the prompt's log-probabilities only (echo), as lm-eval does.
    max_tokens = _check_max_tokens("max_tokens", opt_int(body, "max_tokens", 16),
                                   0 if echo else 1)
    best_of = opt_int(body, "best_of", None)
    if best_of is not None:
        if best_of < fields["n"]:
            raise _bad("best_of", f"'best_of' ({best_of}) must be at least 'n' "
                       f"({fields['n']})")
        if fields["stream"] and best_of > fields["n"]:
            raise _bad("best_of", "'best_of' greater than 'n' cannot be streamed: the best "
                       "sequences are known only at the end")
    return GenerationRequest(kind="completion", prompts=prompts, max_tokens=max_tokens,
                             echo=bool(echo), best_of=best_of, **fields)


def _message_text(i: int, msg: dict[str, Any]) -> str:
    content = msg.get("content")
    if content is None:
        if msg.get("role") == "assistant":  # a reply, or only tool calls
            return ""
        raise _bad("messages", f"messages[{i}].content is required")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else tname(part)
                raise _bad("messages", f"messages[{i}].content part of type {kind!r} is not "
                           "supported (text only)")
            if not isinstance(part.get("text"), str):
                raise _bad("messages", f"messages[{i}].content text part needs a string "
                           "'text'", "invalid_type")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad("messages", f"messages[{i}].content must be a string or an array of text "
               f"parts, got {tname(content)}", "invalid_type")


def parse_chat_request(body: dict[str, Any]) -> GenerationRequest:
    """Validate a POST /v1/chat/completions body."""
    _check_text(body)
    _refuse_unhonoured(body, CHAT_FIELDS)
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _bad("messages", f"'messages' must be an array, got {tname(messages)}",
                   "invalid_type")
    if not messages:
        raise _bad("messages", "'messages' must not be empty")
    flat: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad("messages", f"messages[{i}] must be an object", "invalid_type")
        role = msg.get("role")
        if role not in _ROLES:
            raise _bad("messages", f"messages[{i}].role must be one of {', '.join(_ROLES)}, "
                       f"got {role!r}")
        flat.append(parse_message(i, msg, role, _message_text(i, msg)))
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _check_max_tokens(name, opt_int(body, name, None))
    return GenerationRequest(kind="chat", messages=tuple(flat), max_tokens=max_tokens,
                             tools=parse_tools(body), **sampling_fields(body, "chat"))
