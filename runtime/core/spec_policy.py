"""Adaptive speculation (issue #36): how many tokens to draft for each decoding sequence,
step by step, so that speculation never costs more than it gains.

A verify step is not free. On these CPUs a decode step's time grows with the tokens it
computes (bench/spec_decode.py --profile measures it): t(T) ~ a + b*T for T tokens, plus
a fixed cost per verify entry (its chunk runs the prompt path, and rank 0 checks K more
rows). Drafting k tokens for one sequence in a step of B decoding sequences pays when
the tokens it is expected to gain, E(k) = p + p^2 + ... + p^k for a per-position
acceptance probability p, outweigh what the step loses for everyone: the throughput
(B + E(k)) / (t(B) + verify + b*k) must beat B / t(B). The larger B, the larger the
share of the step the extra tokens cost and the higher the acceptance they need; past
`spec_max_batch_size` sequences (SchedulerConfig, measured) drafting never paid on this
hardware, so nothing is drafted there at all.

p is estimated per sequence from its own verify steps, as an exponential moving average
of Bernoulli trials: a step that accepted a of k drafts counts a successes out of a + 1
trials (a < k: the first rejection is a trial too) or k out of k. It starts optimistic
(copying prompts pay from their first step). When the model says k = 0 the sequence
backs off: no drafts, and no drafter call, for a few decode steps, then a one-token
probe; each probe that is rejected doubles the pause (up to a bound), an accepted one
ends the back-off. Outputs never depend on any of this: greedy verification keeps them
equal to one-token decoding whatever k is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Per-position acceptance assumed before a sequence has verified anything: optimistic, so
# a copying sequence drafts its full K from its first decode step.
PRIOR_ACCEPTANCE = 0.7
# Weight of one verify step in the moving average: about the last 1 / EMA_WEIGHT steps count.
EMA_WEIGHT = 0.3
# Decode steps without drafts after the model first says k = 0, doubled by each rejected
# probe up to MAX_BACKOFF (a sequence that starts copying late is found within that).
MIN_BACKOFF, MAX_BACKOFF = 4, 64


@dataclass(frozen=True, slots=True)
class SpecCost:
    """A decode step's time in units of its fixed cost: 1 + token * T for T tokens, plus
    `verify` for each sequence verifying drafts (measured; see the module docstring)."""

    token: float
    verify: float

    def best_k(self, p: float, k_max: int, batch: int) -> int:
        """The draft length in [0, k_max] that maximises the step's tokens per unit of time
        for one sequence with acceptance p among `batch` decoding ones (0: do not draft)."""
        base = 1.0 + self.token * batch
        best, best_rate = 0, batch / base
        gain, term = 0.0, 1.0
        for k in range(1, k_max + 1):
            term *= p
            gain += term
            rate = (batch + gain) / (base + self.verify + self.token * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


@dataclass(slots=True)
class SeqSpecState:
    successes: float = PRIOR_ACCEPTANCE  # moving averages of accepted drafts ...
    trials: float = 1.0  # ... and of Bernoulli trials (see the module docstring)
    pause: int = 0  # decode steps left without drafts
    backoff: int = MIN_BACKOFF  # the next pause
    probing: bool = False  # the current verify is a one-token probe after a pause

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials if self.trials > 0 else 0.0


@dataclass(slots=True)
class AdaptivePolicy:
    """The scheduler's per-sequence draft lengths (kept beside the drafter, not in it, so
    any drafter plugs in: the scheduler asks `k_for`, calls `drafter.propose(ids, k)` and
    reports each verify step to `observe`)."""

    cost: SpecCost
    max_batch_size: int  # no drafts in a step with more decoding sequences than this
    states: dict[int, SeqSpecState] = field(default_factory=dict)
    backoffs_total: int = 0  # pauses started (a sequence stopped drafting for a while)

    def k_for(self, seq_id: int, k_max: int, batch: int) -> int:
        """Drafts for this sequence's next decode step (call once per decode step: a paused
        sequence counts its pause down here)."""
        if k_max < 1 or batch > self.max_batch_size:
            return 0
        st = self.states.get(seq_id)
        if st is None:
            st = self.states[seq_id] = SeqSpecState()
        if st.pause > 0:
            st.pause -= 1
            if st.pause:
                return 0
            st.probing = True
            return 1
        k = self.cost.best_k(st.acceptance, k_max, batch)
        if k == 0:
            self._pause(st)
        return k

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verify step of `seq_id` kept `accepted` of its `drafted` tokens."""
        st = self.states.get(seq_id)
        if st is None or drafted < 1:
            return
        trials = accepted + (accepted < drafted)
        st.successes += EMA_WEIGHT * (accepted - st.successes)
        st.trials += EMA_WEIGHT * (trials - st.trials)
        if st.probing:
            st.probing = False
            if accepted:
                st.backoff = MIN_BACKOFF  # it copies again: the estimate decides from here
            else:
                st.backoff = min(2 * st.backoff, MAX_BACKOFF)
                self._pause(st)

    def no_draft(self, seq_id: int) -> None:
        """The drafter had nothing to propose: a probe that found nothing is not a failure."""
        st = self.states.get(seq_id)
        if st is not None:
            st.probing = False

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    def _pause(self, st: SeqSpecState) -> None:
        st.pause = st.backoff
        self.backoffs_total += 1

    def describe(self) -> dict[str, object]:
        """For /v1/engine: the policy and its parameters."""
        return {"policy": "adaptive", "max_batch_size": self.max_batch_size,
                "token_cost": self.cost.token, "verify_cost": self.cost.verify,
                "prior_acceptance": PRIOR_ACCEPTANCE, "ema_weight": EMA_WEIGHT,
                "backoff_steps": [MIN_BACKOFF, MAX_BACKOFF]}
