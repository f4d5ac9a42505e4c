"""The engine's requests: each a group of sequences with their sampling state (rank 0).

A request starts as one sequence; with n > 1 (or best_of) it forks into its siblings when
it samples its first token (runtime/core/scheduler.py), each with its own state
(runtime/core/logits.py: random stream, penalty counts, grammar position). `RequestTable`
keeps them by request id and sequence id, draws each step's tokens (siblings' first
tokens from their parent's logits row), gathers prompt log-probabilities, and builds
the events the callbacks receive.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from runtime.core.logits import SeqSampling
from runtime.core.plan import StepPlan
from runtime.core.sampler import Sampler, first_max, make_generator
from runtime.core.scheduler import Scheduler
from runtime.core.sequence import Sequence
from runtime.core.spec import accept_greedy
from runtime.core.types import EventCallback, SamplingParams, TokenEvent, TokenLogprob


@dataclass(slots=True, eq=False)
class Group:
    """One request: its sequences (by index), callback and prompt log-probabilities."""

    request_id: str
    on_event: EventCallback
    params: SamplingParams
    prompt: list[int]
    seq_ids: list[int] = field(default_factory=list)  # index -> seq id
    live: int = 1  # sequences not finished (siblings join when they fork)
    # prompt log-probabilities by position (None at 0), sent with the first token
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_sent: bool = False


@dataclass(slots=True, eq=False)
class SeqEntry:
    """One sequence of a request: its index (choice), sampling state, what went out."""

    group: Group
    index: int
    sampling: SeqSampling
    emitted: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens not yet emitted


class RequestTable:
    """Requests by id and their sequences by seq id; used on the engine thread only."""

    def __init__(self) -> None:
        self.seqs: dict[int, SeqEntry] = {}
        self.groups: dict[str, Group] = {}
        self._ids = itertools.count()

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, sid: int, request_id: str, prompt: list[int], params: SamplingParams,
            cb: EventCallback, sampling: SeqSampling) -> Group:
        group = Group(request_id, cb, params, prompt, [sid])
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt)
        self.seqs[sid] = SeqEntry(group, 0, sampling)
        self.groups[request_id] = group
        return group

    def remove(self, group: Group) -> None:
        for sid in group.seq_ids:
            self.seqs.pop(sid, None)
        self.groups.pop(group.request_id, None)

    def sample(self, sampler: Sampler, scheduler: Scheduler, sampled_ids: list[int],
               logits: torch.Tensor) -> tuple[dict[int, int], dict[int, list[tuple[int, int]]]]:
        """Draw every sampled row; a sequence due to fork also draws its siblings' first
        tokens from its own row, each with its own state and random stream."""
        rows: list[int] = []
        seqs: list[SeqEntry] = []
        owners: list[int] = []  # seq id (existing) or -1 - parent row (a new sibling)
        for r, sid in enumerate(sampled_ids):
            s = self.seqs[sid]
            rows.append(r)
            seqs.append(s)
            owners.append(sid)
            seq = scheduler.get(sid)
            if seq is not None and seq.fork_pending:
                group = s.group
                for k in range(1, group.params.num_sequences):
                    child = SeqEntry(group, k, s.sampling.fork(make_generator(group.params, k)))
                    rows.append(r)
                    seqs.append(child)
                    owners.append(-1 - r)
        # Without forks the rows are the first len(rows) in order: a view, not a gather
        # (an indexed copy of [16, vocab] took ~1 ms a step).
        plain = rows == list(range(len(rows)))
        picks = sampler.sample_seqs(logits[: len(rows)] if plain else logits[rows],
                                    [s.sampling for s in seqs])
        sampled: dict[int, int] = {}
        forks: dict[int, list[tuple[int, int]]] = {}
        for s, owner, (token, lp) in zip(seqs, owners, picks):
            s.sampling.accept(token, lp.logprob if lp is not None else None)
            if lp is not None and s.group.params.logprobs is not None:
                s.logprobs.append(lp)
            if owner >= 0:
                sampled[owner] = token
                continue
            parent = sampled_ids[-1 - owner]
            child_id = self.next_id()
            self.seqs[child_id] = s
            s.group.seq_ids.append(child_id)
            s.group.live += 1
            forks.setdefault(parent, []).append((child_id, token))
        return sampled, forks

    def verify(self, plan: StepPlan, rows: torch.Tensor, sampled: dict[int, int]
               ) -> dict[int, list[int]]:
        """Greedy acceptance (runtime/core/spec.py) of every entry that verified drafts:
        rows [D, V] are the plan's draft rows in order (the row before each draft). Returns
        the drafts each sequence keeps; where one was rejected, its sampled token (drawn
        from the bonus row) becomes the argmax at the rejected position instead."""
        targets = first_max(rows).tolist()  # [D]
        accepted: dict[int, list[int]] = {}
        at = 0
        for entry in plan.scheduled:
            drafts = entry.draft_token_ids
            if not drafts:
                continue
            mine, at = targets[at:at + len(drafts)], at + len(drafts)
            s = self.seqs.get(entry.seq_id)
            if s is None or entry.seq_id not in sampled:
                continue
            a = accept_greedy(drafts, mine)
            if a < len(drafts):
                sampled[entry.seq_id] = mine[a]
            accepted[entry.seq_id] = drafts[:a]
            # Only speculable sequences verify: their state counts tokens and nothing else
            # (no penalties, grammar or log-probabilities), so recording the accepted
            # drafts here and the final token through sample() above keeps it exact.
            for token in drafts[:a]:
                s.sampling.accept(token, None)
        return accepted

    def collect_prompt_logprobs(self, sampler: Sampler, plan: StepPlan, logits: torch.Tensor
                                ) -> None:
        """Rows after the sampled ones: each entry's first `prompt_logits` positions, whose
        logits give the log-probability of the prompt token that follows them."""
        at = 0
        for entry in plan.scheduled:
            k = entry.prompt_logits
            if not k:
                continue
            rows, at = logits[at:at + k], at + k
            s = self.seqs.get(entry.seq_id)
            if s is None or s.group.prompt_logprobs is None:
                continue  # cancelled meanwhile
            group, start = s.group, entry.num_computed_tokens
            targets = group.prompt[start + 1:start + 1 + k]
            lps = sampler.prompt_logprobs(rows, targets, group.params.prompt_logprobs or 0)
            group.prompt_logprobs[start + 1:start + 1 + k] = lps

    def event(self, seq: Sequence) -> tuple[Group, TokenEvent]:
        """The event for a sequence update() returned (its new tokens; its end, which
        forgets the sequence)."""
        s = self.seqs[seq.seq_id]
        group = s.group
        new = seq.output_token_ids[s.emitted:]
        s.emitted = len(seq.output_token_ids)
        logprobs = None
        if group.params.logprobs is not None:
            logprobs, s.logprobs = s.logprobs[:len(new)], s.logprobs[len(new):]
        prompt_logprobs = None
        if s.index == 0 and not group.prompt_sent:
            group.prompt_sent = True
            prompt_logprobs = group.prompt_logprobs
        finish = seq.finish_reason
        cumulative = None
        if finish is not None:
            self.seqs.pop(seq.seq_id)
            group.live -= 1
            if group.params.needs_logprobs:
                cumulative = s.sampling.cumulative_logprob
            if group.live == 0:
                self.groups.pop(group.request_id, None)
        return group, TokenEvent(
            seq.request_id, new, finish, seq.num_prompt_tokens, index=s.index,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(0, seq.num_cached_tokens), cumulative_logprob=cumulative)
