"""POST /v1/responses, OpenAI's Responses API, translated to and from the chat path.

Stateless: nothing is stored, so `previous_response_id`, `conversation` and `store: true`
are 400s naming them (OpenAI's `store` defaults to true, but a client that leaves it out
asks for nothing it needs here: absent and false are accepted). The body becomes a chat
request: `input` (text or a list of items) and `instructions` become messages,
`max_output_tokens` max_tokens, function `tools` and `tool_choice` the chat's shapes,
`text.format` the chat's response_format. The chat answer becomes output items: a
`reasoning` item (with --reasoning-parser), a `message` with its `output_text`, and a
`function_call` per tool call. Streamed, the chat's deltas become the Responses events
(response.created, response.output_item.added, response.output_text.delta, ...,
response.completed, or response.incomplete when max_output_tokens cut the answer).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from serve.api.fields import bad, opt_bool, opt_int, tname
from serve.api.generate import dumps, next_update, serve_generation
from serve.api.protocol import ApiError, GenerationRequest, parse_chat_request
from serve.api.run import Run

__all__ = ["RESPONSES_FIELDS", "ResponsesRequest", "handle_responses", "output_items",
           "parse_responses_request", "response_object", "translate"]

RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
    "stream_options", "tools", "tool_choice", "parallel_tool_calls", "text", "metadata",
    "user", "safety_identifier", "prompt_cache_key"})
# Accepted only with the value that asks for nothing.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "include": ([],), "truncation": ("disabled",), "service_tier": ("auto", "default"),
    "top_logprobs": (0,)}
_STATELESS = ("previous_response_id", "conversation")
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
# A chat field named in an error -> the Responses field the client sent.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated /v1/responses body: the chat body it runs as, and what it echoes."""

    chat: dict[str, Any]
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the answer repeats


def _refuse(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if value is None or name in RESPONSES_FIELDS:
            continue
        if name in _STATELESS:
            raise bad(name, f"'{name}' is not supported: this server is stateless and keeps "
                      "no responses or conversations; send the whole conversation in 'input'",
                      "unsupported_parameter")
        if name == "store":
            if value is False:
                continue
            raise bad("store", "'store': true is not supported: this server keeps no "
                      "responses; send store: false or leave it out", "unsupported_parameter")
        if name == "background" and value is False:
            continue
        if name in _NEUTRAL and type(value) is not bool and value in _NEUTRAL[name]:
            continue
        raise bad(name, f"'{name}' is not supported by this server; remove it",
                  "unsupported_parameter")


def _text(where: str, content: Any, parts: tuple[str, ...] = _TEXT_PARTS) -> str:
    """A string, or a list of text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad("input", f"'{where}' must be a string or an array of text parts, got "
                  f"{tname(content)}", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else tname(part)
        if kind not in parts:
            raise bad("input", f"'{where}[{j}]' of type {kind!r} is not supported (text "
                      f"only: {', '.join(parts)})")
        if not isinstance(part.get("text"), str):
            raise bad("input", f"'{where}[{j}].text' must be a string", "invalid_type")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad("input", f"'{where}.{key}' must be a non-empty string", "invalid_type")
    return value


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", f"'instructions' must be a string, got "
                      f"{tname(instructions)}", "invalid_type")
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if given is None:
        raise bad("input", "'input' is required", "missing_required_parameter")
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad("input", "'input' must be a string or a non-empty array of items",
                  "invalid_type" if not isinstance(given, list) else "invalid_value")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad("input", f"'{where}' must be an object, got {tname(item)}",
                      "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad("input", f"'{where}.role' must be one of {', '.join(_ROLES)}, got "
                          f"{role!r}")
            out.append({"role": role, "content": _text(f"{where}.content",
                                                       item.get("content"))})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": item.get("arguments", "")}}
            if not isinstance(call["function"]["arguments"], str):
                raise bad("input", f"'{where}.arguments' must be a string (JSON)",
                          "invalid_type")
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # parallel calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(f"{where}.output", item.get("output"),
                                         ("input_text",))})
        elif kind == "reasoning":
            continue  # an earlier answer's thinking: not sent back to the model
        else:
            raise bad("input", f"'{where}.type' {kind!r} is not supported (message, "
                      "function_call, function_call_output)")
    return out


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """Function tools (flat: {type, name, description, parameters, strict}) and tool_choice
    in the chat's nested shapes."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", f"'tools' must be an array, got {tname(tools)}", "invalid_type")
        out = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else tname(tool)
            if kind != "function":
                raise bad("tools", f"'tools[{i}]' of type {kind!r} is not supported "
                          "(function tools only)", "unsupported_parameter")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise bad("tools", f"'tools[{i}].name' must be a non-empty string",
                          "invalid_type")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                  if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        if out:
            chat["tools"] = out
    choice = body.get("tool_choice")
    if choice is None or (choice in ("none", "auto") and not chat.get("tools")):
        return  # asks for nothing without tools
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad("tool_choice", "'tool_choice' must be none, auto, required or "
                  "{\"type\": \"function\", \"name\": ...}")
    if body.get("parallel_tool_calls") is not None and chat.get("tools"):
        chat["parallel_tool_calls"] = opt_bool(body, "parallel_tool_calls", True)


def _text_format(body: dict[str, Any], chat: dict[str, Any]) -> None:
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict):
        raise bad("text", f"'text' must be an object, got {tname(text)}", "invalid_type")
    for key, value in text.items():
        if key not in ("format", "verbosity") or (
                key == "verbosity" and value not in (None, "medium")):
            raise bad("text", f"'text.{key}' is not supported", "unsupported_parameter")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is None or kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        assert isinstance(fmt, dict)
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict")
                  if fmt.get(k) is not None}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        raise bad("text", "'text.format.type' must be text, json_object or json_schema",
                  "invalid_value")


def translate(body: dict[str, Any]) -> ResponsesRequest:
    """A /v1/responses body -> the chat body it runs as (400s name Responses fields)."""
    _refuse(body)
    chat: dict[str, Any] = {"messages": _messages(body)}
    max_output = opt_int(body, "max_output_tokens", None)
    if max_output is not None:
        if max_output < 1:
            raise bad("max_output_tokens", f"'max_output_tokens' must be at least 1, got "
                      f"{max_output}")
        chat["max_tokens"] = max_output
    for name in ("model", "temperature", "top_p", "stream", "user"):
        if body.get(name) is not None:
            chat[name] = body[name]
    opts = body.get("stream_options")
    if opts is not None:  # include_obfuscation: there are no obfuscation fields to leave out
        if not isinstance(opts, dict) or set(opts) - {"include_obfuscation"}:
            raise bad("stream_options", "'stream_options' may hold include_obfuscation only",
                      "unsupported_parameter")
        if not body.get("stream"):
            raise bad("stream_options", "'stream_options' is only allowed when 'stream' is "
                      "true")
    _tools(body, chat)
    _text_format(body, chat)
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values())):
        raise bad("metadata", "'metadata' must be an object of strings", "invalid_type")
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "metadata",
                                     "temperature", "top_p", "user", "safety_identifier",
                                     "prompt_cache_key")}
    echo["tools"] = body.get("tools") or []
    echo["tool_choice"] = body.get("tool_choice") or "auto"
    echo["parallel_tool_calls"] = body.get("parallel_tool_calls") is not False
    echo["text"] = body.get("text") or {"format": {"type": "text"}}
    return ResponsesRequest(chat, echo)


def parse_responses_request(body: dict[str, Any]) -> tuple[ResponsesRequest, GenerationRequest]:
    """Validate a /v1/responses body; chat-side errors renamed to the Responses field."""
    resp = translate(body)
    try:
        return resp, parse_chat_request(resp.chat)
    except ApiError as exc:
        raise _renamed(exc) from None


def _renamed(exc: ApiError) -> ApiError:
    """A chat-side error naming the Responses field instead (max_tokens: max_output_tokens)."""
    if exc.param in _PARAMS:
        name = _PARAMS[exc.param]
        exc.message = exc.message.replace(f"'{exc.param}'", f"'{name}'")
        exc.param = name
    return exc


# ---- the answer ---------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict[str, Any], status: str = "completed") -> list[dict[str, Any]]:
    """A chat answer's message (content, reasoning_content, tool_calls) as output items."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
                      "content": [{"type": "reasoning_text",
                                   "text": message["reasoning_content"]}]})
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append({"type": "message", "id": _id("msg"), "status": status,
                      "role": "assistant", "content": [_output_text(message.get("content")
                                                                    or "")]})
    for call in calls:
        fn = call.get("function", {})
        items.append({"type": "function_call", "id": _id("fc"), "call_id": call.get("id"),
                      "name": fn.get("name"), "arguments": fn.get("arguments", ""),
                      "status": "completed"})
    return items


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(resp: ResponsesRequest, rid: str, created: int, model: str,
                    output: list[dict[str, Any]], finish: str | None,
                    usage: dict[str, Any] | None) -> dict[str, Any]:
    """The Response: status completed, incomplete (max_output_tokens), or in_progress
    (finish None: the stream's first events)."""
    status = "in_progress" if finish is None else \
        "incomplete" if finish == "length" else "completed"
    out = {"id": rid, "object": "response", "created_at": created, "status": status,
           "background": False, "error": None,
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
           else None, "model": model, "output": output, "previous_response_id": None,
           "reasoning": None, "store": False, "truncation": "disabled", "service_tier":
           "default", **resp.echo, "usage": None}
    if out["metadata"] is None:
        out["metadata"] = {}
    if usage is not None:
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        out["usage"] = {"input_tokens": prompt, "output_tokens": completion,
                        "total_tokens": prompt + completion,
                        "input_tokens_details": {"cached_tokens": cached,
                                                 "cache_write_tokens": 0},
                        "output_tokens_details": {"reasoning_tokens": 0}}
    return out


async def handle_responses(request: web.Request) -> web.StreamResponse:
    parsed: list[ResponsesRequest] = []

    def parse(body: dict[str, Any]) -> GenerationRequest:
        resp, req = parse_responses_request(body)
        parsed.append(resp)
        return req

    async def respond(request: web.Request, run: Run) -> web.StreamResponse:
        if run.req.stream:
            return await _stream(request, run, parsed[0])
        return await _complete(run, parsed[0])

    try:
        return await serve_generation(request, parse, respond)
    except ApiError as exc:  # the context length, the engine's refusals: chat field names
        raise _renamed(exc) from None


async def _complete(run: Run, resp: ResponsesRequest) -> web.Response:
    while not run.done:
        await next_update(run)
    choice = run.choices[0]
    message = run.final_choice(choice)["message"]
    status = "incomplete" if choice.finish == "length" else "completed"
    body = response_object(resp, _id("resp"), run.created, run.state.model_name,
                           output_items(message, status), choice.finish, run.usage())
    return web.Response(text=dumps(body), content_type="application/json",
                        headers={"X-Request-Id": run.request_id})


class _Events:
    """Chat deltas in, Responses stream events out (as SSE `event:`/`data:` pairs)."""

    def __init__(self, wire: web.StreamResponse) -> None:
        self.wire = wire
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items, in order
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item

    async def send(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        await self.wire.write(f"event: {kind}\ndata: {dumps(event)}\n\n".encode())

    async def _start(self, item: dict[str, Any]) -> None:
        await self.close()
        self.open = item
        await self.send("response.output_item.added", output_index=len(self.items),
                        item={**item, "status": "in_progress"})
        if item["type"] == "message":
            await self.send("response.content_part.added", item_id=item["id"],
                            output_index=len(self.items), content_index=0,
                            part=_output_text(""))

    async def close(self, status: str = "completed") -> None:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "reasoning":
            await self.send("response.reasoning_text.done", **where, content_index=0,
                            text=item["content"][0]["text"])
        elif item["type"] == "message":
            part = item["content"][0]
            await self.send("response.output_text.done", **where, content_index=0,
                            text=part["text"], logprobs=[])
            await self.send("response.content_part.done", **where, content_index=0,
                            part=part)
        else:
            await self.send("response.function_call_arguments.done", **where,
                            name=item["name"], arguments=item["arguments"])
        self.items.append(item)
        await self.send("response.output_item.done", output_index=len(self.items) - 1,
                        item=item)

    async def delta(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                await self._start({"type": "reasoning", "id": _id("rs"), "summary": [],
                                   "content": [{"type": "reasoning_text", "text": ""}]})
            assert self.open is not None
            self.open["content"][0]["text"] += delta["reasoning_content"]
            await self.send("response.reasoning_text.delta", item_id=self.open["id"],
                            output_index=len(self.items), content_index=0,
                            delta=delta["reasoning_content"])
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                await self._start({"type": "message", "id": _id("msg"), "role": "assistant",
                                   "content": [_output_text("")]})
            assert self.open is not None
            self.open["content"][0]["text"] += delta["content"]
            await self.send("response.output_text.delta", item_id=self.open["id"],
                            output_index=len(self.items), content_index=0,
                            delta=delta["content"], logprobs=[])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            item = self.calls.get(call.get("index", 0))
            if item is None:
                item = {"type": "function_call", "id": _id("fc"), "call_id": call.get("id"),
                        "name": fn.get("name"), "arguments": ""}
                self.calls[call.get("index", 0)] = item
                await self._start(item)
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                await self.send("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=len(self.items), delta=fn["arguments"])


async def _stream(request: web.Request, run: Run, resp: ResponsesRequest
                  ) -> web.StreamResponse:
    # As the chat stream: headers go out with the first engine event, so a request the
    # engine rejects at admission still gets a plain HTTP error status.
    pending = await next_update(run)
    wire = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                       "X-Request-Id": run.request_id})
    await wire.prepare(request)
    events = _Events(wire)
    rid, model = _id("resp"), run.state.model_name
    start = response_object(resp, rid, run.created, model, [], None, None)
    try:
        await events.send("response.created", response=start)
        await events.send("response.in_progress", response=start)
        first = True
        while first or not run.done:
            try:
                update = pending if first else await next_update(run)
                first = False
            except ApiError as exc:
                await events.send("error", code=exc.code, message=exc.message,
                                  param=exc.param)
                failed = {**start, "status": "failed", "output": events.items,
                          "error": {"code": exc.code or "server_error",
                                    "message": exc.message}}
                await events.send("response.failed", response=failed)
                break
            if update is None:
                continue
            chunk = run.stream_choice(update.choice, update.text or None, update.finish)
            await events.delta(chunk["delta"])
        else:
            finish = run.choices[0].finish
            if not events.items and events.open is None:  # no output at all: one empty message
                await events._start({"type": "message", "id": _id("msg"), "role": "assistant",
                                     "content": [_output_text("")]})
            await events.close("incomplete" if finish == "length" else "completed")
            done = response_object(resp, rid, run.created, model, events.items, finish,
                                   run.usage())
            kind = "response.incomplete" if done["status"] == "incomplete" \
                else "response.completed"
            await events.send(kind, response=done)
        await wire.write_eof()
    except ConnectionResetError:
        pass  # the client went away; the caller cancels the request in the executor
    return wire


