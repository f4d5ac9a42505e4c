"""Speculative decoding on rank 0: the n-gram drafter (prompt lookup) and greedy acceptance.

A decoding sequence that may speculate is scheduled with 1 + K tokens in one step: its
last sampled token plus K drafted ones (`ScheduledSeq.draft_token_ids`). The model
computes all of them like a prompt chunk and returns a float32 logits row at each: the
row after the last sampled token predicts the first draft, and so on; the row after the
last draft is the ordinary sampled row (the bonus). Greedy acceptance keeps drafts while
each equals the argmax of the row before it; the first mismatch is replaced by that
argmax (the token the plain engine would have produced), or after K accepted the bonus
row's token follows. Outputs are exactly the plain engine's; the scheduler then rolls the
rejected positions back (runtime/core/scheduler.py).

Only sequences whose next token is the argmax of the model's own logits speculate
(`speculable`): sampled requests, log-probabilities, processors and grammars decode one
token at a time, as without speculation.

Drafters satisfy one small protocol (`Drafter`), so that the scheduler (this layer) never
imports the executors: the n-gram drafter here, and the draft engine
(runtime/executors/draft.py), which runs a second model and so must batch its work and
keep per-sequence state. Each step the scheduler calls `prepare` once with every decoding
sequence that may draft (before it knows the budget each gets), then `propose` per
sequence with the k that the step allows, and `forget` when a sequence releases its
blocks (finished, aborted or preempted).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from runtime.core.types import SamplingParams

# n-gram lengths the drafter tries, longest first (vLLM's prompt_lookup_max/min).
NGRAM_MAX = 3
NGRAM_MIN = 1


def speculable(params: SamplingParams, num_output: int, has_stop: bool) -> bool:
    """Whether a sequence's next tokens are the plain argmax of the model's logits, so that
    greedy acceptance is lossless: greedy, no processor that changes the row, no
    log-probabilities, one sequence per request."""
    return (params.greedy and not params.needs_logprobs and params.guided is None
            and params.grammar is None and not params.logit_bias
            and not params.has_penalties and params.num_sequences == 1
            and not (num_output < params.min_tokens and has_stop))


@runtime_checkable
class Drafter(Protocol):
    """What the scheduler needs of a drafter (rank 0 only; plain token ids in and out)."""

    name: str
    num_tokens: int  # K: the most drafts proposed per sequence and step

    def prepare(self, candidates: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """Called once per step before `propose`: (seq id, its tokens, the most drafts it
        may take) for every sequence that may draft this step. A drafter that runs a model
        drafts for all of them here, in one batch."""
        ...

    def propose(self, token_ids: Sequence[int], k: int | None = None,
                seq_id: int | None = None) -> list[int]:
        """Up to k (default K) tokens to verify after `token_ids`; [] for none."""
        ...

    def forget(self, seq_id: int) -> None:
        """The sequence left the running batch: drop whatever is kept for it."""
        ...


class NgramDrafter:
    """Prompt lookup: find the sequence's last n tokens (n = 3, 2, 1) earlier in its prompt
    and output, and propose the tokens that followed them there. The most recent match
    that has K tokens after it wins; failing that, the earliest match (it has the most)."""

    name = "ngram"

    def __init__(self, num_tokens: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.num_tokens = num_tokens
        self.n_max, self.n_min = n_max, n_min

    def prepare(self, candidates: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """Nothing to batch: a lookup costs microseconds and keeps no state."""

    def forget(self, seq_id: int) -> None:
        """No per-sequence state."""

    def propose(self, token_ids: Sequence[int], k: int | None = None,
                seq_id: int | None = None) -> list[int]:
        """Up to k (default K) tokens to verify after `token_ids`; [] if nothing matches."""
        k = self.num_tokens if k is None else k
        n_tokens = len(token_ids)
        if k < 1 or n_tokens < 2:
            return []
        # Search the bytes of int32 ids: bytes.rfind runs in C (a Python loop over a
        # 2k-token sequence every step would cost about a millisecond per n).
        data = array("i", token_ids).tobytes()
        for n in range(min(self.n_max, n_tokens - 1), self.n_min - 1, -1):
            pattern = data[-4 * n:]
            end = len(data) - 4  # a match must end before the last token: one token follows
            best = -1
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4:  # straddles two ids: not a match of whole tokens
                    end = at + 4 * n - 1
                    continue
                start = at // 4 + n  # first token after the match
                best = start
                if n_tokens - start >= k:
                    break
                end = at + 4 * n - 1
            if best >= 0:
                return list(token_ids[best:best + k])
        return []


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many drafts the target keeps: the length of the prefix where draft i equals the
    target's argmax at the position before it (targets[i])."""
    a = 0
    for d, t in zip(drafts, targets):
        if d != t:
            break
        a += 1
    return a
