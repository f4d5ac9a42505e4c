"""The OpenAI error type and the typed field readers every request parser uses.

A field with a wrong type or value is a 400 naming the parameter, in OpenAI's error shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

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


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def tname(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def opt_int(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # some clients serialize 16 as 16.0
    if not is_int(v):
        raise bad(name, f"'{name}' must be an integer, got {tname(v)}", "invalid_type")
    return v


def opt_num(body: Mapping[str, Any], name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not is_num(v):
        raise bad(name, f"'{name}' must be a finite number, got {tname(v)}", "invalid_type")
    return float(v)


def opt_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be a boolean, got {tname(v)}", "invalid_type")
    return v


def in_range(name: str, value: float, lo: float, hi: float) -> float:
    if not lo <= value <= hi:
        raise bad(name, f"'{name}' must be in [{lo:g}, {hi:g}], got {value:g}")
    return value


def int_list(body: Mapping[str, Any], name: str, max_items: int) -> tuple[int, ...]:
    """An optional array of non-negative integers (token ids)."""
    v = body.get(name)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(is_int(t) and t >= 0 for t in v):
        raise bad(name, f"'{name}' must be an array of non-negative integers", "invalid_type")
    if len(v) > max_items:
        raise bad(name, f"'{name}' has {len(v)} entries; at most {max_items} are allowed")
    return tuple(dict.fromkeys(v))
