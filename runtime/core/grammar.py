"""Grammar-constrained sampling with xgrammar (the library TensorRT-LLM and vLLM use).

A `GuidedSpec` (JSON object, JSON Schema, regex, EBNF grammar, or a list of choices) is
compiled once per distinct spec against the tokenizer's vocabulary (`GrammarCompiler`).
Compiling takes milliseconds for a small schema but has no bound: a 63 KB schema of 700
patterned strings took 131.9 s against a 49k-token vocabulary, and its compiled grammar
holds tens of MB. So compiles run on a small pool of worker threads (xgrammar releases
the GIL), a caller waits for one only up to a deadline (xgrammar cannot be interrupted:
an abandoned compile runs on, but only as many as the pool has threads), and compiled
grammars are kept in an LRU cache bounded by their bytes. Each sequence then walks the
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

import concurrent.futures
import json
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.core.types import GuidedSpec

Future = concurrent.futures.Future


class GrammarError(ValueError):
    """The spec does not compile (bad JSON Schema, regex or grammar): the client's fault."""


class GrammarTimeout(GrammarError):
    """The spec did not compile within the deadline (it may still finish, and be cached)."""


@dataclass(frozen=True, slots=True)
class GrammarConfig:
    """Bounds on structured-output compiles: the time a caller waits, the threads that
    compile, and the bytes of compiled grammars kept."""

    compile_timeout_s: float = 5.0
    compile_workers: int = 2
    cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ValueError(f"the grammar compile timeout must be positive, got "
                             f"{self.compile_timeout_s}")
        if self.compile_workers < 1:
            raise ValueError(f"grammar compile workers must be at least 1, got "
                             f"{self.compile_workers}")
        if self.cache_bytes < 0:
            raise ValueError(f"the grammar cache size must be >= 0, got {self.cache_bytes}")


@dataclass(frozen=True, slots=True)
class GrammarStats:
    """A snapshot for /metrics."""

    cache_bytes: int  # compiled grammars kept
    cache_entries: int
    in_flight: int  # compiles queued or running, waited for or abandoned
    compiled: int  # compiles finished (successful or not), since the start


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _clean(exc: Exception) -> str:
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: "; keep the words.
    text = " ".join(str(exc).split())
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)[:500]


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary, caching the results.

    Thread-safe. `start` hands back a future (done at once on a cache hit); the same spec
    asked for while it compiles shares the one compile. A caller that stops waiting
    (deadline, client gone) calls `release`: a compile nobody waits for any more is
    withdrawn if it has not started, and otherwise finishes on its worker and is cached.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 config: GrammarConfig | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.config = config or GrammarConfig()
        self._lock = threading.Lock()  # the cache, the pending compiles, the counters
        self._init_lock = threading.Lock()  # the xgrammar compiler, made on first use
        self._compiler: Any = None
        self._control: torch.Tensor | None = None  # bitmask words: no control byte
        self._cache: OrderedDict[GuidedSpec, tuple[Grammar, int]] = OrderedDict()
        self._cache_bytes = 0
        self._pending: dict[GuidedSpec, tuple[Future[Grammar], list[int]]] = {}
        self._compiled = 0
        self._queue: queue.SimpleQueue[tuple[GuidedSpec, Future[Grammar]]] | None = None

    def _get_compiler(self) -> tuple[Any, torch.Tensor]:
        with self._init_lock:
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
                # xgrammar's own cache is unbounded (cache_limit_bytes=-1) and would keep a
                # second copy of every grammar: ours, bounded by bytes, is the only one.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                     cache_enabled=False)
            assert self._control is not None
            return self._compiler, self._control

    def start(self, spec: GuidedSpec) -> Future[Grammar]:
        """The compile of `spec`, as a future (GrammarError when it does not compile).
        Every `start` must be paired with a `release` once the caller stops waiting."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                done: Future[Grammar] = Future()
                done.set_result(hit[0])
                return done
            pending = self._pending.get(spec)
            if pending is not None:
                pending[1][0] += 1
                return pending[0]
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                for i in range(self.config.compile_workers):
                    # Daemon threads, not a ThreadPoolExecutor: its exit handler joins its
                    # threads, and an abandoned compile could hold the exit for minutes.
                    threading.Thread(target=self._work, args=(self._queue,), daemon=True,
                                     name=f"grammar-compile-{i}").start()
            future: Future[Grammar] = Future()
            self._pending[spec] = (future, [1])
            self._queue.put((spec, future))
        return future

    def release(self, spec: GuidedSpec, future: Future[Grammar]) -> None:
        """The caller no longer waits for `future` (from `start`)."""
        with self._lock:
            pending = self._pending.get(spec)
            if pending is None or pending[0] is not future:
                return  # done (or a cache hit)
            pending[1][0] -= 1
            # Withdrawn only if it has not started (then no CPU is spent on it); a running
            # compile cannot be interrupted and finishes into the cache.
            if pending[1][0] == 0 and future.cancel():
                del self._pending[spec]

    def compile(self, spec: GuidedSpec, timeout: float | None = None) -> Grammar:
        """The compiled grammar of `spec`; GrammarError when it does not compile,
        GrammarTimeout when it has not within `timeout` seconds (None: no deadline)."""
        future = self.start(spec)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise GrammarTimeout(f"did not compile within {timeout:g} s") from None
        finally:
            self.release(spec, future)

    def _work(self, jobs: queue.SimpleQueue[tuple[GuidedSpec, Future[Grammar]]]) -> None:
        while True:
            spec, future = jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # withdrawn: nobody waited for it any more
            try:
                grammar = self._build(spec)
            except BaseException as exc:  # the waiter's to raise (GrammarError and any bug)
                self._finished(spec, None)
                future.set_exception(exc)
            else:
                self._finished(spec, grammar)  # cached before any waiter sees it
                future.set_result(grammar)

    def _build(self, spec: GuidedSpec) -> Grammar:
        compiler, control = self._get_compiler()
        json_kind = spec.kind in ("json_object", "json_schema")
        return Grammar(self._compile(compiler, spec), control if json_kind else None)

    def _finished(self, spec: GuidedSpec, grammar: Grammar | None) -> None:
        """Cache a finished compile (None: it failed); the least recently used grammars
        make room."""
        with self._lock:
            del self._pending[spec]
            self._compiled += 1
            if grammar is None:
                return
            size = int(grammar.compiled.memory_size_bytes)
            if size > self.config.cache_bytes:
                return  # used by its requests, kept by none
            self._cache[spec] = (grammar, size)
            self._cache_bytes += size
            while self._cache_bytes > self.config.cache_bytes:
                _, (_, old) = self._cache.popitem(last=False)
                self._cache_bytes -= old

    def stats(self) -> GrammarStats:
        with self._lock:
            return GrammarStats(cache_bytes=self._cache_bytes, cache_entries=len(self._cache),
                                in_flight=len(self._pending), compiled=self._compiled)

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
                return compiler.compile_grammar(choice_ebnf(spec.value))
        except json.JSONDecodeError as exc:
            raise GrammarError(f"not valid JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_clean(exc)) from None
        raise GrammarError(f"unknown guided decoding kind {spec.kind!r}")


def choice_ebnf(value: str) -> str:
    """A `choice` spec (a JSON array of strings) as EBNF: one alternative per choice (JSON
    string escapes are EBNF's too)."""
    choices = json.loads(value)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


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
