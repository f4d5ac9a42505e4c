"""Speculative decoding as configuration: which drafter, how many tokens it proposes.

Written as text `off`, `ngram` or `ngram:K` (`pipeline build --speculative`, recorded in
the manifest; `serve launch --speculative` overrides it). The drafter itself and the
verification live in runtime/core/spec.py and the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram",)  # prompt lookup; a draft engine (issue #36) is the next method
DEFAULT_NUM_TOKENS = 4
# A verify row is a prompt-like chunk of 1 + K tokens: K stays well inside a step's budget.
MAX_NUM_TOKENS = 15


@dataclass(frozen=True, slots=True)
class Speculative:
    method: str  # one of METHODS
    num_tokens: int = DEFAULT_NUM_TOKENS  # K: drafted tokens verified per step and sequence

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of "
                             f"{', '.join(METHODS)}")
        if (not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool)
                or not 1 <= self.num_tokens <= MAX_NUM_TOKENS):
            raise ValueError(f"speculative tokens must be an integer in [1, {MAX_NUM_TOKENS}], "
                             f"got {self.num_tokens!r}")

    def __str__(self) -> str:
        return f"{self.method}:{self.num_tokens}"

    @classmethod
    def parse(cls, text: str) -> Speculative | None:
        """`off` -> None; `ngram` or `ngram:K` -> the setting; ValueError otherwise."""
        text = text.strip()
        if text == "off":
            return None
        method, sep, k = text.partition(":")
        if not sep:
            return cls(method)
        try:
            num = int(k)
        except ValueError:
            raise ValueError(f"speculative {text!r}: K must be an integer (ngram:K)") from None
        return cls(method, num)

    def to_json(self) -> dict[str, object]:
        return {"method": self.method, "num_tokens": self.num_tokens}

    @classmethod
    def from_json(cls, data: object) -> Speculative | None:
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"speculative must be an object or null, got {data!r}")
        return cls(str(data.get("method")), data.get("num_tokens"))  # type: ignore[arg-type]
