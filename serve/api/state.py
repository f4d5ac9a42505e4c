"""What the HTTP layer shares with the launcher: readiness, the executor, metrics.

The launcher (main thread) writes; the HTTP event loop (its own thread) reads. Every
mutable piece is either guarded by a lock or a single attribute assignment.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from runtime.core.grammar import GrammarCompiler, GrammarConfig, GrammarStats
from runtime.core.types import Executor
from serve.api.choices import TokenTexts
from serve.api.reasoning import reasoning_format
from serve.metrics import ServingMetrics

Phase = Literal["starting", "ready", "draining", "failed"]
PHASES: tuple[Phase, ...] = ("starting", "ready", "draining", "failed")
GateDict = dict[str, Any]  # name, state, start, end, seconds, evidence, reason


class Readiness:
    """The worker's lifecycle phase: starting -> ready -> draining, or failed at any time."""

    def __init__(self, phase: Phase = "starting") -> None:
        self._lock = threading.Lock()
        self._phase: Phase = "starting"
        self._reason: str | None = None
        self.set(phase)

    def set(self, phase: Phase, reason: str | None = None) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown readiness phase {phase!r}; expected one of {PHASES}")
        with self._lock:
            self._phase, self._reason = phase, reason

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._phase

    @property
    def reason(self) -> str | None:
        with self._lock:
            return self._reason

    @property
    def is_ready(self) -> bool:
        return self.phase == "ready"


def _no_gates() -> list[GateDict]:
    return []


def _no_report() -> dict[str, Any]:
    return {}


@dataclass
class ServerState:
    """Everything the HTTP handlers need. `executor` stays None until admission opens.

    tokenizer: a Hugging Face PreTrainedTokenizerBase; may be None while the engine
    directory is still being resolved (generation requests then get 503).
    stop_token_ids: extra end-of-sequence ids (e.g. from generation_config.json) on top of
    the tokenizer's eos_token_id.
    """

    model_name: str
    tokenizer: Any
    max_seq_len: int
    max_queue: int = 256
    executor: Executor | None = None
    readiness: Readiness = field(default_factory=Readiness)
    gates: Callable[[], list[GateDict]] = _no_gates
    engine_report: Callable[[], dict[str, Any]] = _no_report
    metrics: ServingMetrics = field(default_factory=ServingMetrics)
    stop_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # the model's (rows of its embedding); None: the tokenizer's
    max_body_bytes: int = 1 << 20
    api_key: str | None = None  # /v1/* needs "Authorization: Bearer <api_key>" when set
    max_connections: int = 1024
    header_timeout: float = 10.0  # seconds for a new connection's first request header
    # An idle keep-alive connection is closed after this. It must outlast the clients' own
    # pool expiry (aiohttp 15 s, httpx and so the openai client 5 s): when both ends close at
    # the same idle time, a client reuses a connection at the moment the server closes it and
    # gets "Server disconnected" for a request the server never saw (one in ~3,600 in a
    # 30-minute soak at 15 s). 75 s, as nginx and aiohttp's own default.
    keepalive_timeout: float = 75.0
    grammar: GrammarConfig = field(default_factory=GrammarConfig)  # structured-output bounds
    reasoning_parser: str | None = None  # --reasoning-parser: serve/api/reasoning.py's FORMATS
    tool_parser: str | None = None  # --tool-parser (serve/api/tools.py); None: from the template
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must be non-empty")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {self.max_seq_len}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if not self.header_timeout > 0 or not self.keepalive_timeout > 0:
            raise ValueError("header_timeout and keepalive_timeout must be positive")
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._grammar: GrammarCompiler | None = None
        self._texts: TokenTexts | None = None
        self.reasoning = reasoning_format(self.reasoning_parser) \
            if self.reasoning_parser is not None else None

    def open_admission(self, executor: Executor) -> None:
        """Gate 10: attach the executor, then flip readiness so requests can reach it."""
        self.executor = executor
        self.readiness.set("ready")

    def begin_drain(self) -> None:
        """New generation requests get 503; running ones complete. Poll `in_flight()`."""
        self.readiness.set("draining")

    def in_flight(self) -> int:
        """Generation requests the HTTP layer is serving right now (any stage)."""
        with self._in_flight_lock:
            return self._in_flight

    def _enter(self) -> None:
        with self._in_flight_lock:
            self._in_flight += 1

    def _leave(self) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this tokenizer, made on first use (its cache
        of compiled grammars lives as long as the server)."""
        with self._in_flight_lock:
            if self._grammar is None:
                vocab = self.vocab_size if self.vocab_size is not None else len(self.tokenizer)
                self._grammar = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids(),
                                                self.grammar)
            return self._grammar

    def grammar_stats(self) -> GrammarStats | None:
        """The compiler's cache and compiles, for /metrics (None before the first)."""
        with self._in_flight_lock:
            compiler = self._grammar
        return compiler.stats() if compiler is not None else None

    def token_texts(self) -> TokenTexts:
        """token id -> text, for log-probabilities (cached across requests)."""
        with self._in_flight_lock:
            if self._texts is None:
                self._texts = TokenTexts(self.tokenizer)
            return self._texts

    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's eos id(s) plus `stop_token_ids`, de-duplicated."""
        ids: list[int] = list(self.stop_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, (list, tuple)):
            ids.extend(int(e) for e in eos)
        return tuple(dict.fromkeys(ids))


# aiohttp application keys: the handlers find the state and the in-flight generation
# tasks (so `HttpServerHandle.stop` can cancel them) through these.
STATE_KEY: web.AppKey[ServerState] = web.AppKey("llmserve_state", ServerState)
TASKS_KEY: web.AppKey[set[asyncio.Task[Any]]] = web.AppKey("llmserve_tasks", set)
