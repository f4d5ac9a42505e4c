"""Speculative decoding on rank 0: the n-gram drafter (prompt lookup) and acceptance.

A decoding sequence that may speculate is scheduled with 1 + K tokens in one step: its
last sampled token plus K drafted ones (`ScheduledSeq.draft_token_ids`). The model
computes all of them like a prompt chunk and returns a float32 logits row at each: the
row after the last sampled token predicts the first draft, and so on; the row after the
last draft is the ordinary sampled row (the bonus). The scheduler then rolls the rejected
positions back (runtime/core/scheduler.py).

Acceptance (runtime/core/requests.py, `RequestTable.verify`) is lossless for every request
kind: the tokens come out with exactly the distribution of one-token decoding.
- Plain greedy rows (no processor, no log-probabilities): drafts are kept while each
  equals the argmax of the row before it (`accept_greedy`); the first mismatch is replaced
  by that argmax, or after K kept the bonus row's token follows.
- Every other row is decided position by position, each after the one before: the row
  goes through the sequence's processors (penalties, logit_bias, min_tokens, grammar mask)
  in the state after the drafts kept so far, then temperature and top-k/top-p, giving p,
  the distribution the plain sampler would draw from. Greedy: keep the draft iff it is
  p's argmax. Sampled: the rejection rule of Leviathan et al. and Chen et al. (vLLM's
  RejectionSampler): keep draft d with probability min(1, p(d) / q(d)), q the drafter's
  distribution; on the first rejection draw from max(0, p - q) renormalised
  (`keeps_draft`, `residual`). The n-gram drafter is deterministic: q is the point mass
  at d, so d is kept with probability p(d) and the replacement is drawn from p without
  d. A draft the grammar forbids has p(d) = 0 and is always rejected. The random numbers
  come from the sequence's own generator. With a deterministic drafter (q the point mass)
  the rule is carried out as the plain draw kept iff it equals d (`verify_sampled`): one
  number a token, the same token one-token decoding draws, so a seeded request gives the
  same output with and without speculation, whatever the load does to its drafts.
  Log-probabilities of every kept or drawn token are read from the same processed row,
  so they equal one-token decoding's; the sampling state advances only by kept tokens.

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
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from runtime.core.types import SamplingParams

# n-gram lengths the drafter tries, longest first (vLLM's prompt_lookup_max/min).
NGRAM_MAX = 3
NGRAM_MIN = 1


def speculable(params: SamplingParams, num_output: int, has_stop: bool) -> bool:
    """Whether a sequence may verify drafts. Acceptance is lossless for every request kind
    the engine runs (greedy or sampled, processors, grammars, log-probabilities, n > 1),
    so nothing is refused; the scheduler keeps asking so that a request kind that cannot
    be verified exactly (none today) has one place to say so."""
    del params, num_output, has_stop  # every kind speculates (module docstring)
    return True


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


def keeps_draft(p: torch.Tensor, draft: int, u: float, q: torch.Tensor | None = None) -> bool:
    """The rejection rule: keep `draft` with probability min(1, p(d) / q(d)) given u drawn
    uniformly from [0, 1). p: the target's distribution at the draft's position [V]; q:
    the drafter's there [V], None for a deterministic drafter (the point mass at d, q(d) = 1).
    Written as u * q(d) < p(d): no division, and a q(d) of 0 (a drafter that proposes what
    it gives no mass) keeps exactly the drafts the target allows."""
    qd = 1.0 if q is None else float(q[draft])
    return u * qd < float(p[draft])


def verify_sampled(p: torch.Tensor, draft: int, uniform: Callable[[], float],
                   draw: Callable[[torch.Tensor, float], int],
                   q: torch.Tensor | None = None) -> int:
    """The token at a draft's position of a sampled row (the draft itself: kept). p: the
    distribution the plain sampler draws from there [V]; `uniform` the sequence's stream;
    `draw(weights, u)` the plain sampler's inverse-CDF draw.

    A deterministic drafter (q None: the point mass at d, the n-gram drafter and a greedy
    draft engine): the plain draw, kept iff it is the draft. It keeps d with probability
    p(d) and otherwise gives a token from p without d, the rejection rule's own outcome,
    and it is the very token one-token decoding draws from the same stream, one number a
    token: a seeded request gives the same output with speculation as without, whatever
    the load decides about its drafts. A drafter with a distribution q: the rejection rule
    (`keeps_draft`, then a draw from `residual`)."""
    if q is None:
        return draw(p, uniform())
    # Always draw u, even where p(d) is 0 or 1: the stream then advances the same way
    # whatever the logits (one number per position, one more on a rejection).
    if keeps_draft(p, draft, uniform(), q):
        return draft
    return draw(residual(p, draft, q), uniform())


def residual(p: torch.Tensor, draft: int, q: torch.Tensor | None = None) -> torch.Tensor:
    """What to draw from after a rejection: max(0, p - q) [V], not normalised (the
    sampler's inverse CDF scales by the total). For a point-mass q, p without the draft."""
    if q is None:
        return p.index_fill(0, torch.tensor([draft], device=p.device), 0.0)
    return (p - q).clamp_min(0.0)
