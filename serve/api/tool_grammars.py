"""The grammars that keep tool calls valid in the template formats (hermes, llama3_json,
mistral), as EBNF text for the structured-output path (`GuidedSpec("grammar", ...)`).

  required / named  the output is the calls only: the format's markers around JSON built
                    from the tools' schemas.
  auto              free text until the model starts a call, then the call constrained by
                    its tool's schema until its end (xgrammar's structural tags: a trigger
                    such as "<tool_call>" dispatches to the tag of the tool named after it).
                    What starts a call is what the format's parser reads as one:
      hermes       "<tool_call>" anywhere; with parallel calls, text and further calls may
                   follow, else the output ends after the first call.
      mistral      "[TOOL_CALLS]" anywhere, or a bare `[{"` list at the start (a detokenizer
                   may drop the marker's text); one list of calls ends the output.
      llama3_json  `{` (or "<|python_tag|>") as the first thing output: the one call is the
                   whole output. Text may not begin with "{" or "<|" for that reason.

JSON is compact (", " and ": ", no free whitespace), as in runtime/grammar.py, and every
call has the same spelling its parser expects: `{"name": "<tool>", "arguments": {...}}`
(`"parameters"` for llama3_json).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Protocol


class Tool(Protocol):
    """What a grammar needs of a tool (serve.api.tools.Tool): its name and argument schema."""

    @property
    def name(self) -> str: ...

    @property
    def parameters(self) -> dict[str, Any]: ...

_WS = r"[ \t\n\r]*"


def args_key(fmt: str) -> str:
    return "parameters" if fmt == "llama3_json" else "arguments"


def call_schema(tool: Tool, key: str = "arguments") -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, key: tool.parameters},
            "required": ["name", key], "additionalProperties": False}


def _list_schema(tools: Sequence[Tool], key: str, many: bool) -> dict[str, Any]:
    calls = [call_schema(t, key) for t in tools]
    array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1
                             else {"anyOf": calls}, "minItems": 1}
    if not many:
        array["maxItems"] = 1
    return array


def _json_ebnf(schema: dict[str, Any]) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


def required_grammar(tools: Sequence[Tool], fmt: str, many: bool) -> str:
    """EBNF for `required` / a named function: one or (`many`) several calls, nothing else."""
    import xgrammar as xgr

    key = args_key(fmt)
    calls = [call_schema(t, key) for t in tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt == "mistral":
        schema, before, after, sep = _list_schema(tools, key, many), "[TOOL_CALLS]", "", None
    elif fmt == "hermes":
        schema, before, after, sep = one, "<tool_call>\n", "\n</tool_call>", "\n" if many \
            else None
    else:  # llama3_json: one call (Llama 3.1's template does not take parallel calls)
        schema, before, after, sep = one, "", "", None
    json_part = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}") for s in (before, after) if s]
    body = xgr.Grammar.concat(*parts[:1], json_part, *parts[1:]) if before else \
        xgr.Grammar.concat(json_part, *parts)
    text = str(body)
    if sep is None:
        return text
    text = re.sub(r"^root ::= ", "tool_call ::= ", text, count=1, flags=re.M)
    return f"root ::= tool_call ({json.dumps(sep)} tool_call)*\n{text}"


def auto_grammar(tools: Sequence[Tool], fmt: str, many: bool) -> str:
    """EBNF for `auto`: free text, and every call the model starts valid (module doc)."""
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    def ebnf(text: str) -> st.GrammarFormat:
        return st.GrammarFormat(grammar=text)

    def call(t: Tool, before: str, end: str) -> st.TagFormat:
        # The tag of one tool: its name is spelled out in `begin`, its arguments follow.
        begin = f'{before}{{"name": {json.dumps(t.name)}, "{args_key(fmt)}": '
        return st.TagFormat(begin=begin, content=ebnf(_json_ebnf(t.parameters)), end=end)

    leading = ebnf(f"root ::= {_WS}")
    fmt_: Any
    if fmt == "hermes":
        fmt_ = st.TriggeredTagsFormat(triggers=["<tool_call>"], tags=[
            call(t, "<tool_call>\n", "}\n</tool_call>") for t in tools],
            stop_after_first=not many)
    elif fmt == "mistral":
        calls = ebnf(_json_ebnf(_list_schema(tools, "arguments", many)))
        marked = st.TriggeredTagsFormat(triggers=["[TOOL_CALLS]"], tags=[
            st.TagFormat(begin="[TOOL_CALLS]", content=calls, end="")], stop_after_first=True)
        # A bare list at the start is a call too (parse_mistral): text may not open with
        # "[{" or "[T" (the marker spelled in pieces).
        fmt_ = st.OrFormat(elements=[
            st.SequenceFormat(elements=[leading, calls]),
            st.SequenceFormat(elements=[leading, st.ConstStringFormat(value="[TOOL_CALLS]"),
                                        calls]),
            st.SequenceFormat(elements=[
                ebnf(f'root ::= {_WS} ([^[ \\t\\n\\r] | "[" [^{{T])'), marked]),
            leading])
    elif fmt == "llama3_json":
        tags = [call(t, before, "}") for t in tools for before in ("", "<|python_tag|>")]
        fmt_ = st.OrFormat(elements=[
            st.SequenceFormat(elements=[leading, st.OrFormat(elements=tags)]),
            st.SequenceFormat(elements=[
                ebnf(f'root ::= {_WS} ([^{{< \\t\\n\\r] | "<" [^|])'), st.AnyTextFormat()]),
            leading])
    else:
        raise ValueError(f"no auto grammar for the tool format {fmt!r}")
    return str(xgr.Grammar.from_structural_tag(st.StructuralTag(format=fmt_)))
