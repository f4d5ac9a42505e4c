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
from runtime.core.sampler import Sampler, first_max, make_generator, plain_greedy
from runtime.core.scheduler import Scheduler
from runtime.core.sequence import Sequence
from runtime.core.spec import accept_greedy, verify_sampled
from runtime.core.types import EventCallback, SamplingParams, TokenEvent, TokenLogprob


def _draw(sampler: Sampler, weights: torch.Tensor, u: float) -> int:
    """The plain sampler's draw from weights [V] (not necessarily normalised) at u."""
    u_t = torch.tensor([u], dtype=torch.float32, device=weights.device)  # [1]
    return int(sampler.inverse_cdf(weights.unsqueeze(0), u_t)[0])


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
               logits: torch.Tensor, plan: StepPlan | None = None
               ) -> tuple[dict[int, int], dict[int, list[tuple[int, int]]]]:
        """Draw every sampled row; a sequence due to fork also draws its siblings' first
        tokens from its own row, each with its own state and random stream. Rows of the
        plan's verify entries that `verify` decides position by position are left to it
        (their bonus row may only be processed once every draft before it is kept)."""
        exact = self._exact(plan) if plan is not None else set()
        rows: list[int] = []
        seqs: list[SeqEntry] = []
        owners: list[int] = []  # seq id (existing) or -1 - parent row (a new sibling)
        for r, sid in enumerate(sampled_ids):
            if sid in exact:
                continue
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
        sampled: dict[int, int] = {}
        forks: dict[int, list[tuple[int, int]]] = {}
        if not rows:
            return sampled, forks
        # Without forks the rows are the first len(rows) in order: a view, not a gather
        # (an indexed copy of [16, vocab] took ~1 ms a step).
        plain = rows == list(range(len(rows)))
        picks = sampler.sample_seqs(logits[: len(rows)] if plain else logits[rows],
                                    [s.sampling for s in seqs])
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

    def _exact(self, plan: StepPlan) -> set[int]:
        """The plan's verify entries decided position by position: all but plain greedy
        sequences (whose drafts only need the argmax of each raw row)."""
        if not plan.num_draft_rows:
            return set()
        return {e.seq_id for e in plan.scheduled if e.draft_token_ids and e.seq_id in self.seqs
                and not plain_greedy(self.seqs[e.seq_id].sampling)}

    def verify(self, sampler: Sampler, plan: StepPlan, sampled_ids: list[int],
               logits: torch.Tensor, draft_start: int, sampled: dict[int, int]
               ) -> dict[int, list[int]]:
        """Acceptance (runtime/core/spec.py) of every entry that verified drafts: logits
        are the step's rows, the plan's draft rows from `draft_start` on, in order (the
        row before each draft), the bonus rows among the first len(sampled_ids). Returns
        the drafts each sequence keeps and sets its token in `sampled`: the bonus row's
        after K kept, else the replacement drawn at the first rejected position."""
        draft_rows = logits[draft_start:]  # [D, V]
        exact = self._exact(plan)
        bonus_row = {sid: r for r, sid in enumerate(sampled_ids)}
        targets: list[int] = []
        if any(e.draft_token_ids and e.seq_id not in exact for e in plan.scheduled):
            targets = first_max(draft_rows).tolist()  # [D]; one call for all entries
        accepted: dict[int, list[int]] = {}
        at = 0
        for entry in plan.scheduled:
            drafts = entry.draft_token_ids
            if not drafts:
                continue
            sid, first, at = entry.seq_id, at, at + len(drafts)
            s = self.seqs.get(sid)
            if s is None:
                continue
            if sid in exact:
                accepted[sid], sampled[sid] = self._verify_exact(
                    sampler, s, drafts, draft_rows[first:at], logits[bonus_row[sid]])
                continue
            if sid not in sampled:
                continue
            mine = targets[first:at]
            a = accept_greedy(drafts, mine)
            if a < len(drafts):
                sampled[sid] = mine[a]
            accepted[sid] = drafts[:a]
            # A plain greedy state counts tokens and nothing else (no penalties, grammar or
            # log-probabilities), so recording the kept drafts after the final token
            # (through sample() above) keeps it exact.
            for token in drafts[:a]:
                s.sampling.accept(token, None)
        return accepted

    @staticmethod
    def _verify_exact(sampler: Sampler, s: SeqEntry, drafts: list[int], rows: torch.Tensor,
                      bonus: torch.Tensor) -> tuple[list[int], int]:
        """One sequence's drafts, position by position: rows [K, V] (before each draft),
        bonus [V]. Each row is processed in the state after the drafts kept before it,
        exactly as one-token decoding would have processed it; the state, log-probabilities
        included, advances by kept tokens and the final one only. Returns the kept drafts
        and the token after them."""
        st = s.sampling
        params = st.params
        want_lp = params.logprobs is not None
        stops = st.stop_token_ids
        kept: list[int] = []
        for i, d in enumerate(drafts):
            tempered = sampler.process(rows[i:i + 1], [st])  # [1, V]
            if params.greedy:  # p is the point mass at the argmax
                token = int(first_max(tempered)[0])
            else:
                p = sampler.cut_probs(tempered, [params])  # [1, V]
                token = verify_sampled(p[0], d, lambda: sampler.uniform(st.generator),
                                       lambda w, u: _draw(sampler, w, u))
            lp = (sampler.token_logprob(tempered[0], token, params.logprobs or 0)
                  if params.needs_logprobs else None)
            st.accept(token, lp.logprob if lp is not None else None)
            if lp is not None and want_lp:
                s.logprobs.append(lp)
            if token != d:
                return kept, token
            kept.append(d)
            if d in stops:
                # The sequence ends at this token (the scheduler stops it there): nothing
                # after it is decided, and the token returned with it is never used.
                return kept, d
        ((token, lp_bonus),) = sampler.sample_seqs(bonus.unsqueeze(0), [st])
        st.accept(token, lp_bonus.logprob if lp_bonus is not None else None)
        if lp_bonus is not None and want_lp:
            s.logprobs.append(lp_bonus)
        return kept, token

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
