"""Grammar-constrained sampling with xgrammar (the library TensorRT-LLM and vLLM use).

A `GuidedSpec` (JSON object, JSON Schema, regex, EBNF grammar, or a list of choices) is
compiled once per distinct spec against the tokenizer's vocabulary (`GrammarCompiler`,
an LRU cache; compiling a large schema takes milliseconds to seconds, so the HTTP layer
does it off the event loop and off the engine thread). Each sequence then walks the
compiled grammar with its own `GrammarMatcher`; before every draw the matcher fills a
token bitmask that the sampler applies to the logits, so only tokens that keep the
output a valid prefix of the language survive, and the stop tokens only once the output
is complete.

JSON is generated compactly (no free whitespace between tokens, ", " and ": " as
separators): with free whitespace allowed a model can stall in an endless run of blanks
(a known failure of vLLM's default), and compact JSON parses the same. xgrammar's JSON
strings admit raw control characters (U+0000-U+001F), which JSON forbids unescaped and
strict parsers (Python's json, JavaScript's JSON.parse) reject; compact JSON has no raw
control character anywhere, so for JSON grammars every token containing one is masked too.

xgrammar takes seconds to import (it pulls in triton), so it is imported on first use.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.types import GuidedSpec

CACHE_SIZE = 256  # compiled grammars kept (distinct specs)


class GrammarError(ValueError):
    """The spec does not compile (bad JSON Schema, regex or grammar): the client's fault."""


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _clean(exc: Exception) -> str:
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: "; keep the words.
    text = " ".join(str(exc).split())
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)[:500]


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary, caching the results.

    Thread-safe: the HTTP layer's worker threads compile concurrently; xgrammar's own
    compiler is thread-safe, the cache is guarded by a lock.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._control: torch.Tensor | None = None  # bitmask words: no control byte
        self._cache: OrderedDict[GuidedSpec, Grammar] = OrderedDict()

    def _get_compiler(self) -> tuple[Any, torch.Tensor]:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                # The model's vocabulary may be padded past the tokenizer's: the extra ids
                # decode to nothing and the mask never allows them.
                size = max(self.vocab_size, len(self._tokenizer))
                stops = list(self.stop_token_ids) or None
                if hasattr(self._tokenizer, "xgrammar_info"):  # runtime/tokenizer.py's
                    info = self._tokenizer.xgrammar_info(size, stops)
                else:  # a Hugging Face tokenizer
                    info = xgr.TokenizerInfo.from_huggingface(
                        self._tokenizer, vocab_size=size, stop_token_ids=stops)
                control = [any(c < 0x20 for c in piece) and i not in self.stop_token_ids
                           for i, piece in enumerate(info.decoded_vocab)]
                self._control = _pack(~torch.tensor(control, dtype=torch.bool))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            assert self._control is not None
            return self._compiler, self._control

    def compile(self, spec: GuidedSpec) -> Grammar:
        """The compiled grammar of `spec`; GrammarError when it does not compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiler, control = self._get_compiler()
        json_kind = spec.kind in ("json_object", "json_schema")
        compiled = Grammar(self._compile(compiler, spec), control if json_kind else None)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    @property
    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)

    @staticmethod
    def _compile(compiler: Any, spec: GuidedSpec) -> Any:
        """xgrammar's CompiledGrammar of `spec`."""
        try:
            if spec.kind == "json_object":
                # Any JSON object (OpenAI's JSON mode), properties unconstrained.
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    strict_mode=False)
            if spec.kind == "json_schema":
                json.loads(spec.value)  # a clear message for text that is not JSON at all
                return compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.value)
            if spec.kind == "choice":
                choices = json.loads(spec.value)
                # One EBNF alternative per choice; JSON string escapes are EBNF's too.
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        except json.JSONDecodeError as exc:
            raise GrammarError(f"not valid JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_clean(exc)) from None
        raise GrammarError(f"unknown guided decoding kind {spec.kind!r}")


def _bit(j: int) -> int:
    """Bit j of an int32 bitmask word, as the signed value torch stores."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> xgrammar's bitmask words [ceil(V / 32)] int32 (bit j of word w: token
    32 w + j)."""
    words = -(-allowed.shape[0] // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:allowed.shape[0]] = allowed.to(torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """A compiled spec: xgrammar's CompiledGrammar, and the tokens allowed besides it (as
    bitmask words, ANDed into the matcher's; None: no further restriction)."""

    compiled: Any
    allowed: torch.Tensor | None = None  # [ceil(V / 32)] int32


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: Grammar, stop_token_ids: Sequence[int],
                 matcher: Any = None) -> None:
        self.grammar = grammar
        self._stop = list(stop_token_ids)
        # The request's own stop tokens end the output (its eos ids and stop_token_ids),
        # whatever the tokenizer declares.
        self._m = matcher if matcher is not None else _xgr().GrammarMatcher(
            grammar.compiled, override_stop_tokens=self._stop or None)

    def fork(self) -> GrammarState:
        return GrammarState(self.grammar, self._stop, self._m.fork())

    @property
    def stop_token_ids(self) -> list[int]:
        return self._stop

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar did not allow it."""
        if self._m.is_terminated():
            return True  # the stop token was accepted already; the sequence is ending
        return bool(self._m.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


def apply_grammars(logits: torch.Tensor, rows: Sequence[tuple[int, GrammarState]]) -> None:
    """Mask, in place, the tokens each listed row's grammar forbids (logits [m, V] float32)."""
    if not rows:
        return
    xgr = _xgr()
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)  # [m, W] int32, all allowed
    for row, state in rows:
        state.fill(bitmask, row)
        allowed = state.grammar.allowed
        if allowed is not None:
            n = min(allowed.shape[0], bitmask.shape[1])
            bitmask[row, :n] &= allowed[:n]
        if not bool(bitmask[row].any()):
            # A grammar that allows nothing next (say left recursion: root ::= root "a")
            # would leave no token to draw: end the output with a stop token instead.
            for token in state.stop_token_ids:
                if token < vocab:
                    bitmask[row, token // 32] |= _bit(token % 32)
    # xgrammar's kernel (C++ on CPU, CUDA/Triton on GPUs) touches the listed rows only;
    # elementwise torch ops on a [V] row cost more, and far more when threads contend.
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab,
                                    indices=[r for r, _ in rows])
