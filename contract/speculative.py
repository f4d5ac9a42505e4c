"""Speculative decoding as configuration: which drafter, how many tokens it proposes.

Written as text (`pipeline build --speculative`, recorded in the manifest; `serve launch
--speculative` overrides it):

- `off`;
- `ngram` or `ngram:K`: prompt lookup (runtime/core/spec.py);
- `draft:ENGINE` or `draft:ENGINE:K`: a second, smaller or quantized engine with the same
  tokenizer proposes K tokens greedily (runtime/executors/draft.py), for example the same
  model's int4_wo engine drafting for its bf16 engine (self-speculation). ENGINE is a
  local engine directory; it may itself contain ':' (the last `:K` is taken as K only when
  it is an integer).

The drafter itself and the verification live in runtime/ and the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft")
DEFAULT_NUM_TOKENS = 4
# A verify row is a prompt-like chunk of 1 + K tokens: K stays well inside a step's budget.
MAX_NUM_TOKENS = 15


@dataclass(frozen=True, slots=True)
class Speculative:
    method: str  # one of METHODS
    num_tokens: int = DEFAULT_NUM_TOKENS  # K: drafted tokens verified per step and sequence
    # method "draft": the draft engine's directory, and (recorded by `pipeline build`) its
    # engine id, so that a server refuses a different engine found at that path later.
    engine: str | None = None
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of "
                             f"{', '.join(METHODS)}")
        if (not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool)
                or not 1 <= self.num_tokens <= MAX_NUM_TOKENS):
            raise ValueError(f"speculative tokens must be an integer in [1, {MAX_NUM_TOKENS}], "
                             f"got {self.num_tokens!r}")
        if self.method == "draft" and not self.engine:
            raise ValueError("speculative draft needs the draft engine's directory "
                             "(draft:ENGINE_DIR[:K])")
        if self.method != "draft" and (self.engine or self.engine_id):
            raise ValueError(f"speculative {self.method} takes no draft engine")

    def __str__(self) -> str:
        if self.method == "draft":
            return f"draft:{self.engine}:{self.num_tokens}"
        return f"{self.method}:{self.num_tokens}"

    @classmethod
    def parse(cls, text: str) -> Speculative | None:
        """`off` -> None; `ngram[:K]`, `draft:ENGINE[:K]` -> the setting; ValueError
        otherwise."""
        text = text.strip()
        if text == "off":
            return None
        method, sep, rest = text.partition(":")
        if method == "draft":
            head, colon, k = rest.rpartition(":")
            if colon and k.strip().lstrip("-").isdigit():  # draft:ENGINE:K
                return cls("draft", int(k), engine=head)
            return cls("draft", engine=rest or None)
        if not sep:
            return cls(method)
        try:
            num = int(rest)
        except ValueError:
            raise ValueError(f"speculative {text!r}: K must be an integer (ngram:K)") from None
        return cls(method, num)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"method": self.method, "num_tokens": self.num_tokens}
        if self.engine is not None:
            out["engine"] = self.engine
        if self.engine_id is not None:
            out["engine_id"] = self.engine_id
        return out

    @classmethod
    def from_json(cls, data: object) -> Speculative | None:
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"speculative must be an object or null, got {data!r}")
        engine, engine_id = data.get("engine"), data.get("engine_id")
        return cls(str(data.get("method")), data.get("num_tokens"),  # type: ignore[arg-type]
                   None if engine is None else str(engine),
                   None if engine_id is None else str(engine_id))
