"""Types shared by the executors (torch, trtllm) and the HTTP layer.

The HTTP layer talks to an executor only through `Executor`: it submits token ids with
`SamplingParams`, receives `TokenEvent`s through a callback (called from the executor's
thread, never from the event loop), and may cancel. Stop *strings* are the HTTP layer's
job (they need detokenization); stop *token ids* are the executor's.

Field names follow the OpenAI/vLLM request fields they come from, so an executor that
cannot honour one raises `UnsupportedParameter` naming it, and the client gets a 400 that
names the field instead of an answer that silently ignored it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# "rejected": refused at admission, the request's own fault (a 400); "error": the engine
# failed while serving it (a 500).
FinishReason = Literal["stop", "length", "cancelled", "rejected", "error"]
GuideKind = Literal["json_object", "json_schema", "regex", "grammar", "choice"]
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
# Scheduling priority (vLLM's `priority`: lower is served earlier, 0 the default); the
# bound keeps it an int32, as a client may send any JSON integer.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


class UnsupportedParameter(ValueError):
    """An executor cannot honour a sampling field: the client gets a 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """Structured output: a grammar the sampled text must match.

    kind json_object: any JSON object (value unused); json_schema: a JSON Schema (JSON
    text); regex: a regular expression; grammar: EBNF (xgrammar's GBNF dialect); choice:
    a JSON array of the allowed strings.
    """

    kind: GuideKind
    value: str = ""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logits processors, applied in this order before temperature (as vLLM does).
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # stop tokens are masked until this many tokens are out
    repetition_penalty: float = 1.0  # on prompt and output tokens (CTRL / HF / vLLM)
    presence_penalty: float = 0.0  # on output tokens (OpenAI's definition)
    frequency_penalty: float = 0.0
    # Sequences: best_of are generated from one prefill, the n best are returned (by
    # cumulative log-probability); None means best_of = n.
    n: int = 1
    best_of: int | None = None
    # Log-probabilities: None = none; k >= 0 = the chosen token's plus the top k.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    guided: GuidedSpec | None = None
    # The compiled form of `guided` for executors that constrain sampling themselves
    # (xgrammar's CompiledGrammar, see runtime/core/grammar.py); compiled by the caller, off
    # the engine thread, and cached per spec.
    grammar: Any = field(default=None, compare=False, repr=False)
    # Scheduling, not sampling: lower values are admitted (and keep their rows) first.
    priority: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.n < 1 or self.num_sequences < self.n:
            raise ValueError(f"need 1 <= n <= best_of, got n={self.n}, best_of={self.best_of}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        lo, hi = PRIORITY_RANGE
        if (not isinstance(self.priority, int) or isinstance(self.priority, bool)
                or not lo <= self.priority <= hi):
            raise ValueError(f"priority must be an integer in [{lo}, {hi}], got "
                             f"{self.priority!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_sequences(self) -> int:
        """Sequences generated for the request (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def needs_logprobs(self) -> bool:
        """The chosen token's log-probability is needed (asked for, or to rank best_of)."""
        return self.logprobs is not None or self.num_sequences > self.n


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability and the top alternatives at its position (id, logprob),
    best first. For prompt tokens: the model's own distribution; for sampled tokens: the
    distribution the sampler drew from (after processors and temperature)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one sequence after one step; its last event carries finish_reason.

    A request with n > 1 (or best_of) has several sequences, told apart by `index`; each
    ends with its own event that has a finish_reason. "rejected", "error" and "cancelled"
    end the whole request.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    error: str | None = None  # set with finish_reason "rejected" or "error"
    index: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    # The first event of sequence 0 carries the prompt's: None for its first token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache (or a shared prefill) served
    cumulative_logprob: float | None = None  # on a sequence's last event, when tracked


@dataclass(slots=True)
class ExecutorStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # held by requests
    kv_blocks_cached: int = 0  # prefix-cached, held by no request (reusable, evictable)
    preemptions_total: int = 0
    steps_total: int = 0
    tokens_last_step: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


EventCallback = Callable[[TokenEvent], None]


class Executor(Protocol):
    """What rank 0's HTTP layer needs from an engine. All methods are thread-safe.

    `add_request` raises `UnsupportedParameter` for a field the engine cannot honour,
    ValueError for a request it refuses otherwise."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_event: EventCallback,
    ) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> ExecutorStats: ...

    def num_unfinished(self) -> int: ...
