"""A request as the scheduler sees it: tokens, progress through the KV cache, blocks held."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from runtime.core.types import FinishReason, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted; holds no blocks
    RUNNING = "running"  # admitted; the runners know it and it holds blocks
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's state on rank 0.

    Known tokens are `prompt_token_ids + output_token_ids`; the first `num_computed_tokens`
    of them are in the KV cache, in `block_ids`. The scheduler makes computed catch up with
    known: a prefill computes many at once (maybe over several steps), a decode one.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    arrival: int = -1  # set by Scheduler.add: first come, first served (within a priority)
    # Prefix caching: keys of this sequence's full blocks by content (they never change, so
    # they survive preemption), and how many of its blocks the cache already knows.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Prompt tokens served by the prefix cache (or a parent's prefill) at first admission.
    num_cached_tokens: int = -1
    # Its prompt positions still owe logits rows (prompt log-probabilities, echo).
    want_prompt_logits: bool = False
    # n > 1: the sequence forks into its siblings when it samples its first token.
    fork_pending: bool = False
    # Batch rows held for it and its siblings until it forks (the scheduler sets it at
    # admission, at most the request's fair share); siblings beyond it wait for rows.
    fork_rows: int = 1

    @property
    def token_ids(self) -> list[int]:
        """All known tokens (a new list): prompt then output."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens not yet in the KV cache."""
        return self.num_tokens - self.num_computed_tokens
