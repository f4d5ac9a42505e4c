"""Types shared by the executors (torch, trtllm) and the HTTP layer.

The HTTP layer talks to an executor only through `Executor`: it submits token ids with
`SamplingParams`, receives `TokenEvent`s through a callback (called from the executor's
thread, never from the event loop), and may cancel. Stop *strings* are the HTTP layer's
job (they need detokenization); stop *token ids* are the executor's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

# "rejected": refused at admission, the request's own fault (a 400); "error": the engine
# failed while serving it (a 500).
FinishReason = Literal["stop", "length", "cancelled", "rejected", "error"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one request after one step; the last event carries finish_reason."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    error: str | None = None  # set with finish_reason "rejected" or "error"


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
    """What rank 0's HTTP layer needs from an engine. All methods are thread-safe."""

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
