"""The sampling and output fields shared by /v1/completions and /v1/chat/completions.

Ranges follow OpenAI's (penalties in [-2, 2], logit_bias in [-100, 100], n up to 128) and
vLLM's extensions (top_k, repetition_penalty, min_tokens, stop_token_ids, ignore_eos, up to
20 log-probabilities, `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`). Token ids are checked against the vocabulary later, in prompt.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from runtime.core.types import MAX_LOGPROBS, PRIORITY_RANGE, GuidedSpec
from serve.api.fields import (
    bad,
    in_range,
    int_list,
    is_num,
    opt_bool,
    opt_int,
    opt_num,
    tname,
)

MAX_SEED = 2**63 - 1
MAX_N = 128  # OpenAI's bound; the engine's batch size may be smaller (then a 400 too)
MAX_LOGIT_BIAS = 1024  # entries
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # per stop string: the matcher holds back this much text per request
MAX_SCHEMA_CHARS = 64 * 1024  # a JSON Schema, regex or grammar, as text
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "'stop' must be a string or an array of strings", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} "
                  "are allowed")
    if any(s == "" for s in stops):
        raise bad("stop", "'stop' strings must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"'stop' strings may be at most {MAX_STOP_CHARS} characters long")
    return tuple(dict.fromkeys(stops))  # de-duplicated, order kept


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad("logit_bias", "'logit_bias' must be an object mapping token ids to biases",
                  "invalid_type")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"'logit_bias' has {len(v)} entries; at most "
                  f"{MAX_LOGIT_BIAS} are allowed")
    out: dict[int, float] = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except ValueError:
            raise bad("logit_bias", f"'logit_bias' keys must be token ids, got {key!r}",
                      "invalid_type") from None
        if token < 0 or str(token) != key.strip():
            raise bad("logit_bias", f"'logit_bias' keys must be token ids, got {key!r}")
        if not is_num(bias) or not -100 <= bias <= 100:
            raise bad("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], "
                      f"got {bias!r} for token {token}")
        out[token] = float(bias)
    return tuple(out.items())


def _logprobs(body: Mapping[str, Any], kind: Literal["completion", "chat"]) -> int | None:
    """Top alternatives per token, or None when log-probabilities are off."""
    if kind == "completion":
        k = opt_int(body, "logprobs", None)
        if k is not None:
            in_range("logprobs", k, 0, MAX_LOGPROBS)
        return k
    on = opt_bool(body, "logprobs", False)
    top = opt_int(body, "top_logprobs", None)
    if top is not None:
        in_range("top_logprobs", top, 0, MAX_LOGPROBS)
        if not on and top > 0:
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if on else None


def _schema_text(param: str, value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_SCHEMA_CHARS:
        raise bad(param, f"'{param}' is {len(text)} characters; at most {MAX_SCHEMA_CHARS} "
                  "are allowed")
    return text


def _response_format(v: object) -> GuidedSpec | None:
    if not isinstance(v, dict):
        raise bad("response_format", "'response_format' must be an object", "invalid_type")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object")
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise bad("response_format", "response_format json_schema needs "
                      "'json_schema': {'name': ..., 'schema': {...}}", "invalid_type")
        schema = spec.get("schema", {})  # absent: any JSON, as OpenAI's SDK allows
        return GuidedSpec("json_schema", _schema_text("response_format", schema))
    raise bad("response_format", "'response_format' type must be 'text', 'json_object' or "
              f"'json_schema', got {kind!r}")


def _guided(body: Mapping[str, Any]) -> tuple[GuidedSpec | None, str | None]:
    """response_format, or one of vLLM's guided_* extensions (at most one of them), and
    the field it came from."""
    given = [name for name in ("response_format", *GUIDED_FIELDS) if body.get(name) is not None]
    specs: list[tuple[GuidedSpec, str]] = []
    for name in given:
        v = body[name]
        if name == "response_format":
            spec = _response_format(v)
            if spec is None:
                continue
        elif name == "guided_json":
            if not isinstance(v, (dict, str, bool)):
                raise bad(name, f"'{name}' must be a JSON Schema (object or string)",
                          "invalid_type")
            spec = GuidedSpec("json_schema", _schema_text(name, v))
        elif name == "guided_choice":
            if (not isinstance(v, list) or not v or
                    not all(isinstance(c, str) and c for c in v)):
                raise bad(name, f"'{name}' must be a non-empty array of non-empty strings",
                          "invalid_type")
            spec = GuidedSpec("choice", _schema_text(name, v))
        else:
            if not isinstance(v, str) or not v:
                raise bad(name, f"'{name}' must be a non-empty string", "invalid_type")
            spec = GuidedSpec("regex" if name == "guided_regex" else "grammar",
                              _schema_text(name, v))
        specs.append((spec, name))
    if len(specs) > 1:
        raise bad(given[-1], f"only one of {', '.join(given)} may be given")
    return specs[0] if specs else (None, None)


def _priority(body: Mapping[str, Any]) -> int:
    """vLLM's `priority`: an integer, lower is scheduled earlier (runtime/core/scheduler.py)."""
    priority = opt_int(body, "priority", 0)
    assert priority is not None
    in_range("priority", priority, *PRIORITY_RANGE)
    return priority


def sampling_fields(body: Mapping[str, Any], kind: Literal["completion", "chat"]
                    ) -> dict[str, Any]:
    """Every GenerationRequest field but the prompt, messages and max_tokens."""
    temperature = opt_num(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise bad("temperature", f"'temperature' must be in [0, 2], got {temperature}")
    top_p = opt_num(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad("top_p", f"'top_p' must be in (0, 1], got {top_p}")
    top_k = opt_int(body, "top_k", 0)
    assert top_k is not None
    if top_k == -1:
        top_k = 0  # vLLM's spelling of "disabled"
    if top_k < 0:
        raise bad("top_k", f"'top_k' must be >= 0 (0 or -1 disables it), got {top_k}")
    seed = opt_int(body, "seed", None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad("seed", f"'seed' must be in [0, 2^63-1], got {seed}")
    stream = opt_bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "'stream_options' must be an object", "invalid_type")
        if not stream:
            raise bad("stream_options", "'stream_options' is only allowed when 'stream' is "
                      "true")
        include_usage = opt_bool(opts, "include_usage", False)
        for key, value in opts.items():  # e.g. vLLM's continuous_usage_stats: not honoured
            if key != "include_usage" and value not in (None, False):
                raise bad("stream_options", f"'stream_options.{key}' is not supported",
                          "unsupported_parameter")
    if body.get("tools") and kind == "completion":  # chat: tools.py
        raise bad("tools", "'tools' is only supported by /v1/chat/completions",
                  "unsupported_parameter")
    n = opt_int(body, "n", 1)
    assert n is not None
    in_range("n", n, 1, MAX_N)
    repetition = opt_num(body, "repetition_penalty", 1.0)
    if not 0.0 < repetition <= 100.0:
        raise bad("repetition_penalty", f"'repetition_penalty' must be in (0, 100], got "
                  f"{repetition}")
    min_tokens = opt_int(body, "min_tokens", 0)
    assert min_tokens is not None
    if min_tokens < 0:
        raise bad("min_tokens", f"'min_tokens' must be >= 0, got {min_tokens}")
    guided, guided_param = _guided(body)
    ignore_eos = opt_bool(body, "ignore_eos", False)
    if guided is not None and ignore_eos:
        raise bad("ignore_eos", "'ignore_eos' cannot be combined with structured output: "
                  "the grammar ends the output with the end-of-sequence token")
    if not isinstance(body.get("model", ""), (str, type(None))):
        raise bad("model", f"'model' must be a string, got {tname(body['model'])}",
                  "invalid_type")
    return {
        "model": body.get("model"), "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "seed": seed, "stop": _stop(body), "stream": stream,
        "include_usage": include_usage, "ignore_eos": ignore_eos, "n": n,
        "logprobs": _logprobs(body, kind),
        "presence_penalty": in_range("presence_penalty",
                                     opt_num(body, "presence_penalty", 0.0), -2.0, 2.0),
        "frequency_penalty": in_range("frequency_penalty",
                                      opt_num(body, "frequency_penalty", 0.0), -2.0, 2.0),
        "repetition_penalty": repetition, "logit_bias": _logit_bias(body),
        "min_tokens": min_tokens,
        "stop_token_ids": int_list(body, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        "guided": guided, "guided_param": guided_param,
        "priority": _priority(body),
    }
