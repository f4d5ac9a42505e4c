"""Chat tool calling: the request's tools, the prompt they go into, the grammar that keeps
the calls valid, and the calls parsed back out of the model's text.

Formats (`--tool-parser`, else detected from the chat template):
  generic      templates that know nothing of tools (SmolLM2's). The tools are described in a
               system message and the output is one JSON object, `{"tool_calls": [{"name",
               "arguments"}, ...]}` or `{"response": "..."}`, constrained by a JSON Schema
               from the first token (llama.cpp's "generic" handling): every choice is
               guaranteed to parse, and every call's arguments to match its tool's schema.
  hermes       Hermes / Qwen 2.5+: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
  llama3_json  Llama 3.1-3.3: `{"name": ..., "parameters": {...}}`, optionally after
               `<|python_tag|>`, several separated by `;`.
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (and v11's
               `[TOOL_CALLS]name[ARGS]{...}`).
For the template formats the template renders the tools (its `tools` variable, as
transformers' apply_chat_template passes it); `required` and a named function are
constrained by an EBNF grammar built from the tools' schemas (so valid too), and `auto`
by a grammar of free text in which every call the model starts is constrained the same way
(serve/api/tool_grammars.py).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from runtime.core.types import GuidedSpec
from serve.api.fields import ApiError, bad, tname
from serve.api.tool_grammars import auto_grammar, call_schema, required_grammar

FORMATS = ("generic", "hermes", "llama3_json", "mistral")
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
# What opens a call when it is the first thing output, without the marker (a detokenizer
# may drop a special token's text; Llama 3.x writes its JSON bare).
_OPENINGS = {"llama3_json": "{", "mistral": '[{"'}


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema of the arguments object

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A request's tools and how they may be used; `fmt` is set once the template is known."""

    tools: tuple[Tool, ...]
    choice: str  # auto | required | a tool's name (named)
    named: bool = False
    parallel: bool = True
    fmt: str = "generic"

    @property
    def must_call(self) -> bool:
        return self.choice == "required" or self.named

    def allowed(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if t.name == self.choice) if self.named \
            else self.tools

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets beside the messages (the generic format has already
        put the tools into a system message)."""
        if self.fmt == "generic":
            return {}
        return {"tools": [t.as_openai() for t in self.tools]}


# ---- the request ---------------------------------------------------------------------------

def _tool(i: int, v: object) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(v, dict):
        raise bad("tools", f"'{where}' must be an object, got {tname(v)}", "invalid_type")
    if v.get("type", "function") != "function":
        raise bad("tools", f"'{where}.type' must be 'function', got {v.get('type')!r} (only "
                  "function tools are supported)")
    fn = v.get("function")
    if not isinstance(fn, dict):
        raise bad("tools", f"'{where}.function' must be an object", "invalid_type")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad("tools", f"'{where}.function.name' must be 1-64 letters, digits, '_', '.' "
                  f"or '-', got {name!r}")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad("tools", f"'{where}.function.description' must be a string", "invalid_type")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad("tools", f"'{where}.function.parameters' must be a JSON Schema object, got "
                  f"{tname(params)}", "invalid_type")
    if params.get("type", "object") != "object":
        raise bad("tools", f"'{where}.function.parameters' must describe an object (type "
                  f"'object'), got type {params.get('type')!r}")
    unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise bad("tools", f"'{where}.function.{unknown[0]}' is not supported",
                  "unsupported_parameter")
    return Tool(name, desc or "", params)


def parse_tools(body: Mapping[str, Any]) -> ToolSpec | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> a ToolSpec, or None when the request
    asks for no tool use (no tools, or tool_choice "none")."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean, got "
                  f"{tname(parallel)}", "invalid_type")
    if raw is not None and not isinstance(raw, list):
        raise bad("tools", f"'tools' must be an array, got {tname(raw)}", "invalid_type")
    if len(raw or ()) > MAX_TOOLS:
        raise bad("tools", f"'tools' has {len(raw or ())} entries; at most {MAX_TOOLS} are "
                  "allowed")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw or ()))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad("tools", f"'tools' names the function {dup!r} twice")
    named = False
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str):
            raise bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", "invalid_type")
        choice, named = fn["name"], True
        if choice not in names:
            raise bad("tool_choice", f"'tool_choice' names the function {choice!r}, which is "
                      "not in 'tools'")
    elif choice not in ("none", "auto", "required"):
        raise bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or a "
                  f"named function, got {choice!r}")
    if not tools:
        if choice not in ("none", "auto") or body.get("tool_choice") not in (None, "none"):
            raise bad("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if choice == "none":
        return None
    return ToolSpec(tools, choice, named, parallel if parallel is not None else True)


def _arguments_object(where: str, value: object) -> Any:
    """An assistant message's call arguments (a JSON string, per OpenAI) as an object, for
    templates (they `tojson` them)."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise bad("messages", f"'{where}' must be a string of JSON", "invalid_type")
    try:
        return json.loads(value) if value.strip() else {}
    except json.JSONDecodeError:
        raise bad("messages", f"'{where}' is not valid JSON") from None


def parse_message(i: int, msg: Mapping[str, Any], role: str, content: str) -> dict[str, Any]:
    """A chat message with its tool fields kept: an assistant's `tool_calls`, a tool
    result's `tool_call_id` (and `name`)."""
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad("messages", f"messages[{i}].tool_call_id is required for a 'tool' "
                      "message (a string)", "missing_required_parameter")
        out["tool_call_id"] = call_id
        if isinstance(msg.get("name"), str):
            out["name"] = msg["name"]
    calls = msg.get("tool_calls")
    if calls is not None and role == "assistant":
        if not isinstance(calls, list):
            raise bad("messages", f"messages[{i}].tool_calls must be an array", "invalid_type")
        parsed = []
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad("messages", f"'{where}' must be {{'id', 'type': 'function', "
                          "'function': {'name', 'arguments'}}", "invalid_type")
            parsed.append({"id": str(call.get("id") or ""), "type": "function",
                           "function": {"name": fn["name"], "arguments": _arguments_object(
                               f"{where}.function.arguments", fn.get("arguments", "{}"))}})
        out["tool_calls"] = parsed
    return out


# ---- format, prompt and grammar ------------------------------------------------------------

def detect_format(template: str | None) -> str:
    """The tool format a chat template speaks, from its markers; generic when it renders no
    tools at all."""
    if not template or "tools" not in template:
        return "generic"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "generic"


def _calls_schema(spec: ToolSpec) -> dict[str, Any]:
    calls = [call_schema(t) for t in spec.allowed()]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if spec.named or not spec.parallel:
        array["maxItems"] = 1
    return array


def generic_schema(spec: ToolSpec) -> dict[str, Any]:
    """The generic format's output: a list of calls, or (auto) a message instead."""
    calls = {"type": "object", "properties": {"tool_calls": _calls_schema(spec)},
             "required": ["tool_calls"], "additionalProperties": False}
    if spec.must_call:
        return calls
    message = {"type": "object", "properties": {"response": {"type": "string"}},
               "required": ["response"], "additionalProperties": False}
    return {"anyOf": [calls, message]}


def _generic_system(spec: ToolSpec) -> str:
    tools = json.dumps([{"name": t.name, "description": t.description,
                         "parameters": t.parameters} for t in spec.tools], ensure_ascii=False)
    calls = ('{"tool_calls": [{"name": "<the tool\'s name>", "arguments": {<its '
             'arguments>}}]}')
    if spec.named:
        how = f"Call the tool {spec.choice} and answer with: {calls}"
    elif spec.choice == "required":
        how = f"Call one or more of the tools, answering with: {calls}"
    else:
        how = (f"To call tools, answer with: {calls}\nTo answer the user directly, answer "
               'with: {"response": "<your answer>"}')
    return f"You can call these tools:\n{tools}\n\n{how}\nAnswer with JSON only."


def _generic_messages(messages: Sequence[Mapping[str, Any]], spec: ToolSpec
                      ) -> tuple[dict[str, Any], ...]:
    """Tool calls and results spelled out in the JSON the model answers with, as text
    (llama.cpp's polyfills): a template without tool support renders them."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                names[c["id"]] = c["function"]["name"]
                calls.append({"name": c["function"]["name"],
                              "arguments": c["function"]["arguments"]})
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            result = {"tool": m.get("name") or names.get(m["tool_call_id"], ""),
                      "tool_call_id": m["tool_call_id"], "content": m["content"]}
            out.append({"role": "user", "content": json.dumps({"tool_response": result},
                                                              ensure_ascii=False)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    system = _generic_system(spec)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return tuple(out)


def prepare(req: Any, template: str | None, parser: str | None,
            constrain_auto: bool = True) -> Any:
    """A chat request with tools, ready for the template: its format chosen, its messages
    rewritten for the generic format, its grammar set (ApiError when it cannot be).
    `constrain_auto` False (a backend without grammars): `auto` in a template format is
    parsed from free text only."""
    spec: ToolSpec = req.tools
    fmt = parser or detect_format(template)
    spec = replace(spec, fmt=fmt)
    if req.guided is not None and (spec.must_call or fmt == "generic"):
        param = req.guided_param or "response_format"
        raise bad(param, f"'{param}' cannot be combined with 'tools' here: the tool calls "
                  "have a grammar of their own", "unsupported_parameter")
    messages = req.messages
    guided, guided_param = req.guided, req.guided_param
    if fmt == "generic":
        messages = _generic_messages(messages, spec)
        guided = GuidedSpec("json_schema", json.dumps(generic_schema(spec)))
        guided_param = "tool_choice" if spec.named else "tools"
    elif spec.must_call or (constrain_auto and guided is None):
        # auto with response_format / guided_*: theirs is the grammar, calls are parsed.
        build = required_grammar if spec.must_call else auto_grammar
        try:
            guided = GuidedSpec("grammar", build(spec.allowed(), fmt,
                                                 spec.parallel and not spec.named))
        except Exception as exc:  # xgrammar's error for a schema it cannot build
            raise bad("tools", f"'tools' parameters do not compile to a grammar: {exc}") \
                from None
        guided_param = "tool_choice" if spec.named else "tools"
    return replace(req, tools=spec, messages=messages, guided=guided,
                   guided_param=guided_param)


# ---- parsing the output --------------------------------------------------------------------

def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _scan_string(text: str, i: int) -> tuple[str, int | None]:
    """The decoded JSON string that opens at text[i] ('"') and the index after its closing
    quote, or what it holds so far and None when the text ends inside it."""
    out: list[str] = []
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == '"':
            return "".join(out), j + 1
        if c != "\\":
            out.append(c)
            j += 1
            continue
        if j + 1 >= n:
            break
        e = text[j + 1]
        if e != "u":
            out.append({"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}.get(e, e))
            j += 2
            continue
        if j + 6 > n:
            break
        code = int(text[j + 2:j + 6], 16)
        if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves, or wait for them
            if j + 12 > n:
                break
            if text[j + 6:j + 8] == "\\u":
                low = int(text[j + 8:j + 12], 16)
                if 0xDC00 <= low < 0xE000:
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    j += 12
                    continue
        out.append(chr(code))
        j += 6
    return "".join(out), None


def _skip_value(text: str, i: int) -> int | None:
    """The index after the JSON value at text[i]; None when the text ends inside it."""
    n = len(text)
    if i >= n:
        return None
    if text[i] == '"':
        return _scan_string(text, i)[1]
    if text[i] not in "[{":
        j = i
        while j < n and text[j] not in ",]} \n\r\t":
            j += 1
        return j if j < n else None
    depth, j = 0, i
    while j < n:
        c = text[j]
        if c == '"':
            end = _scan_string(text, j)[1]
            if end is None:
                return None
            j = end
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \n\r\t":
        i += 1
    return i


@dataclass
class _Partial:
    """A call as far as the text goes: its name once complete, its arguments' JSON text."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class _Scan:
    content: str | None = None  # the response so far (generic auto)
    calls: list[_Partial] | None = None
    complete: bool = False


def scan_generic(text: str) -> _Scan:
    """The generic format's JSON read as far as it goes (a prefix while streaming)."""
    out = _Scan()
    i = _ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return out
    i = _ws(text, i + 1)
    if i >= len(text) or text[i] != '"':
        return out
    key, end = _scan_string(text, i)
    if end is None:
        return out
    i = _ws(text, end)
    if i >= len(text) or text[i] != ":":
        return out
    i = _ws(text, i + 1)
    if key == "response":
        if i < len(text) and text[i] == '"':
            out.content, end = _scan_string(text, i)
            out.complete = end is not None and text[_ws(text, end):].strip() == "}"
        return out
    if key != "tool_calls" or i >= len(text) or text[i] != "[":
        return out
    out.calls = []
    i += 1
    while True:
        i = _ws(text, i)
        if i >= len(text):
            return out
        if text[i] == "]":
            out.complete = text[_ws(text, i + 1):].strip() == "}"
            return out
        if text[i] == ",":
            i += 1
            continue
        if text[i] != "{":
            return out
        call = _Partial()
        out.calls.append(call)
        i += 1
        while True:  # the members of one call
            i = _ws(text, i)
            if i >= len(text):
                return out
            if text[i] == ",":
                i += 1
                continue
            if text[i] == "}":
                call.done = True
                i += 1
                break
            if text[i] != '"':
                return out
            key, end = _scan_string(text, i)
            if end is None:
                return out
            i = _ws(text, end)
            if i >= len(text) or text[i] != ":":
                return out
            i = _ws(text, i + 1)
            if key == "name" and i < len(text) and text[i] == '"':
                name, end = _scan_string(text, i)
                if end is None:
                    return out
                call.name = name
            else:
                end = _skip_value(text, i)
                if key == "arguments":
                    call.arguments = text[i:len(text) if end is None else end]
                if end is None:
                    return out
            i = end


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _from_obj(obj: object, args_keys: tuple[str, ...] = ("arguments", "parameters")
              ) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _json_sequence(text: str, sep: str = ";") -> list[Any] | None:
    """Consecutive JSON values separated by `sep` (and blanks); None unless all parse."""
    dec, out, i = json.JSONDecoder(), [], _ws(text, 0)
    while i < len(text):
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(obj)
        i = _ws(text, i)
        if i < len(text) and text[i] == sep:
            i = _ws(text, i + 1)
    return out


def _calls(objs: Sequence[object] | None) -> list[ToolCall] | None:
    if not objs:
        return None
    calls = [_from_obj(o) for o in objs]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], re.S):
        got = _calls(_json_sequence(block.strip()))
        if got is None:
            return text, []
        calls += got
    return text[:start].strip(), calls


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    calls = _calls(_json_sequence(body, ";"))
    return ("", calls) if calls else (text, [])


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        # The marker is a special token a detokenizer may drop: a bare call list counts.
        stripped = text.strip()
        if stripped.startswith('[{"name"'):
            try:
                flat = _calls(json.loads(stripped))
            except json.JSONDecodeError:
                flat = None
            return ("", flat) if flat else (text, [])
        return text, []
    content, rest = text[:start].strip(), text[start:]
    calls: list[ToolCall] = []
    for piece in filter(None, (p.strip() for p in rest.split("[TOOL_CALLS]"))):
        if piece.startswith("["):  # v3: a JSON list of calls
            try:
                got = _calls(json.loads(piece))
            except json.JSONDecodeError:
                got = None
        else:  # v11: name[ARGS]{...}
            name, sep, args = piece.partition("[ARGS]")
            got = None
            if sep:
                try:
                    got = _calls([{"name": name.strip(), "arguments": json.loads(args)}])
                except json.JSONDecodeError:
                    got = None
        if got is None:
            return text, []
        calls += got
    return content, calls


def parse_generic(text: str) -> tuple[str, list[ToolCall]]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:  # cut short (max_tokens): the response or calls so far
        scan = scan_generic(text)
        if scan.calls:
            done = [{"name": c.name, "arguments": c.arguments} for c in scan.calls if c.done]
            return "", _calls(done) or []
        return (scan.content if scan.content is not None else text), []
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return obj["response"], []
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        calls = _calls(obj["tool_calls"])
        if calls:
            return "", calls
    return text, []


PARSERS = {"generic": parse_generic, "hermes": parse_hermes,
           "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def parse_output(fmt: str, text: str) -> tuple[str, list[ToolCall]]:
    """The message's text and its tool calls (none: the text is all content)."""
    return PARSERS[fmt](text)


def check_parser(name: str | None) -> str | None:
    if name is not None and name not in FORMATS:
        raise ValueError(f"--tool-parser must be one of {', '.join(FORMATS)}, got {name!r}")
    return name


# ---- streaming -----------------------------------------------------------------------------

class ToolStream:
    """One choice's output as OpenAI chat deltas: content pieces and `tool_calls` entries
    (index, id, type and name first, then `function.arguments` pieces), which the `openai`
    client's stream helpers assemble. The generic format streams the response's text and
    each call's arguments as they are generated; the template formats stream text up to a
    call's marker and the calls once the output is complete."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.text = ""
        self.sent_content = 0  # characters of content sent
        self.sent_args: list[int] = []  # per call: characters of its arguments sent
        self.ids: list[str] = []
        self.held = False  # a template format: a call has begun, the rest is held

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def push(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta for `text` newly generated ({} when nothing can be sent yet)."""
        self.text += text
        if self.fmt == "generic":
            return self._generic(final)
        return self._native(final)

    def _delta(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _generic(self, final: bool) -> dict[str, Any]:
        scan = scan_generic(self.text)
        content = ""
        if scan.content is not None:
            content = scan.content[self.sent_content:]
            self.sent_content = len(scan.content)
        calls: list[dict[str, Any]] = []
        for k, call in enumerate(scan.calls or ()):
            if call.name is None:
                break
            entry: dict[str, Any] = {"index": k}
            if k == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                entry.update(id=self.ids[k], type="function",
                             function={"name": call.name, "arguments": ""})
            piece = call.arguments[self.sent_args[k]:]
            if piece:
                entry.setdefault("function", {})["arguments"] = piece
                self.sent_args[k] = len(call.arguments)
            if len(entry) > 1:
                calls.append(entry)
        if final and scan.calls is None and scan.content is None and not self.sent_content:
            content = self.text  # not the format at all (cannot happen under the grammar)
        return self._delta(content, calls)

    def _native(self, final: bool) -> dict[str, Any]:
        marker = _MARKERS[self.fmt]
        if not self.held:
            at = self.text.find(marker)
            lead = self.text.lstrip()
            opening = _OPENINGS.get(self.fmt, "") if not self.text[:self.sent_content].strip() \
                else ""
            if opening and lead.startswith(opening):  # a call without its marker
                at = len(self.text) - len(lead)
            if at >= 0:
                self.held = True
                content = self.text[self.sent_content:at]
                self.sent_content = at
            else:
                # Hold back what may be the start of a marker.
                keep = next((k for k in range(min(len(marker), len(self.text)), 0, -1)
                             if marker.startswith(self.text[-k:])), 0)
                if opening and opening.startswith(lead):  # may yet open a call
                    keep = len(self.text)
                end = len(self.text) if final else len(self.text) - keep
                content = self.text[self.sent_content:end]
                self.sent_content = max(self.sent_content, end)
                return self._delta(content, [])
        else:
            content = ""
        if not final:
            return self._delta(content, [])
        _, calls = parse_output(self.fmt, self.text)
        if not calls:  # the marker led to no valid call: it was text after all
            return self._delta(content + self.text[self.sent_content:], [])
        entries = []
        for k, call in enumerate(calls):
            self.ids.append(call.id)
            entries.append({"index": k, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
        return self._delta(content, entries)


def refuse_backend(spec: ToolSpec, why: str) -> ApiError:
    return ApiError(400, why, param="tool_choice" if spec.named else "tools",
                    code="unsupported_parameter")
