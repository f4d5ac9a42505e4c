"""Iteration-level scheduler: one `StepPlan` per step, in the style of vLLM v1.

There are no prefill and decode phases. Every sequence has known tokens (prompt + output)
and computed tokens (in the KV cache); each step hands out a token budget so that computed
catches up with known. A long prompt is computed over several steps (chunked prefill), a
decode is one token (the one sampled last step), and both share a step.

Per step: running sequences first, in schedule order, each taking min(uncomputed, budget
left) tokens (prompt chunks also within `max_prefill_tokens_while_decoding` while some
sequence decodes, and within `max_prefill_tokens_while_waiting` in a step that admits a
waiting one); then waiting sequences while the batch has room, budget is left and the
KV blocks for their first chunk are free. Blocks are allocated for exactly the tokens
computed this step. When a running sequence needs a block and none is free, the last
running sequence in schedule order (maybe itself) is preempted: its blocks are freed and it
goes back to the queue, to be recomputed from prompt + output when readmitted. No sequence
is admitted in a step that preempted.

Schedule order: `priority` (lower first, vLLM's convention), then arrival (first come,
first served). Both queues keep it, so a high-priority request is admitted first, gets the
budget first and is the last to be preempted for blocks. It does not preempt running
requests to be admitted (as vLLM's priority policy admits: when a row frees).

Fair admission (issue #37), on top:
- Shares. Each request present (running or waiting) may hold max_batch_size // requests
  batch rows (at least one); n and best_of count against it. The next sequence admitted is
  the first, among the best priority waiting, whose request holds less than its share.
  When one such waits and every row is taken, requests over their share (and not more
  important) give rows back, one at a time: a sibling reservation shrinks, else their last
  sibling is preempted (recomputed later; the prefix cache serves what it still holds).
  Alone, a request may take every row; rows are taken back only for someone who waits.
- First tokens behind a long prompt. While sequences wait and rows are free, running prompt
  chunks leave part of the step's tokens to them (what they need, at most half of the
  step's prompt tokens), so a short request arriving during a long prefill is admitted and
  sampled in its first step, and the long prompt still gets at least half of every step.
  Leaving tokens is not enough on its own: the requests added between two steps wait for
  the step in flight, and the step that admits them also carried the rest of the long
  prompt's chunk (484 tokens of a 996-token prompt on a 512-token budget), so the short
  request's first token came in the same step as the long prompt's. In a step that admits
  a waiting sequence, running prompt chunks (of no more important requests) therefore
  take at most `max_prefill_tokens_while_waiting` tokens in all: the newcomer's first
  token comes one short step after the step in flight, and the long prompt still
  progresses every step (by that cap at least, when nothing else takes the budget).

Liveness: the first running sequence in schedule order is never preempted for another one
(block preemption takes the last; row preemption leaves each request its first), and `add`
rejects what could not fit in the pool alone, so it always progresses.

n > 1 (and best_of): one sequence computes the prompt; when it samples its first token the
engine samples its siblings' first tokens from the same logits, and `update` forks them:
each sibling shares the prompt's full KV blocks (reference counts) and gets a copy of the
last, partly filled one (copy-on-write, `StepPlan.copied_blocks`), so the prompt is
prefilled once. Batch rows for the siblings are reserved when the first one is admitted
(`Sequence.fork_rows`: what is free, within the request's share); siblings beyond them wait
holding nothing and are recomputed when admitted.

Prompt log-probabilities (echo) need logits at every prompt position: such a sequence
skips the prefix cache, and its chunks are capped so that a step's logits rows stay
within `max_logit_rows` (the compiled step function's bound).

Speculative decoding (runtime/core/spec.py; `SchedulerConfig.speculative`): a decoding
sequence that may speculate and whose drafter proposes something is scheduled with its
last sampled token plus K drafts in one entry (`ScheduledSeq.draft_token_ids`), K within
the tokens max_tokens still allows (so no KV position past the request's bound is ever
written), the step's budget and logits rows left after one token and one row for every
later running sequence, and only with blocks free for them (drafts never preempt). After
the step (`update`, given the accepted prefix of the drafts) the sequence's computed
tokens are its old ones plus the last sampled token and the accepted drafts; blocks that
held only rejected positions are freed at once (the next plan tells the runners to cut
their block tables, `block_table_lens`), and the prefix cache only ever registers full
blocks of computed, known tokens, so never one holding a rejected draft. Accepted tokens
join the output one by one, so a stop token or max_tokens among them ends the sequence
exactly where one-token decoding would. How many drafts a sequence gets is the adaptive
policy's (runtime/core/spec_policy.py, `SchedulerConfig.spec_adaptive`): from the
sequence's own acceptance and the step's decode batch, none past
`spec_max_batch_size` decoding sequences, and none (not even a drafter lookup) while a
sequence whose drafts were rejected is backing off. The drafter only proposes
(`drafter.propose(token_ids, k)`), so any drafter plugs in under the same policy.

Call order: `schedule()`, run the plan on every rank, `update(plan, sampled, forks)`, repeat;
`add` and `abort` go between steps. Not thread-safe: the engine loop serialises calls.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Mapping
from collections.abc import Sequence as Seq

from runtime.core.kv_cache import BlockManager, hash_block
from runtime.core.limits import output_budget, stop_ids
from runtime.core.plan import NewSeq, ScheduledSeq, StepPlan
from runtime.core.scheduler_config import SchedulerConfig, SchedulerStats
from runtime.core.sequence import SeqStatus, Sequence
from runtime.core.spec import Drafter, NgramDrafter, speculable
from runtime.core.spec_policy import AdaptivePolicy, SpecCost
from runtime.core.types import FinishReason

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]


def schedule_order(seq: Sequence) -> tuple[int, int]:
    """Both queues' order: priority (lower first, as vLLM's), then arrival. Siblings share
    their parent's key and stay in the order they joined."""
    return (seq.params.priority, seq.arrival)


class Scheduler:
    """Decides each step, and owns the state it changes: the sequences (waiting, running), the
    block manager, what the next plan must tell the runners (freed sequences, appended
    tokens, block copies) and the counters. The private methods at the end finish, preempt
    and fork sequences and keep the prefix cache's registrations, always leaving blocks,
    queues and runners' knowledge in agreement."""

    def __init__(self, config: SchedulerConfig, drafter: Drafter | None = None) -> None:
        """`drafter`: the one a draft engine needs (runtime/executors/draft.py, built by the
        executor layer, which this layer may not import); n-gram drafting needs none."""
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self._waiting: list[Sequence] = []  # schedule_order (preempted ones rejoin by it)
        self._running: list[Sequence] = []  # schedule_order
        self._stop_ids: dict[int, frozenset[int]] = {}
        self._known_to_runners: set[int] = set()
        self._fresh_forks: set[int] = set()  # forked, running, not yet sent to the runners
        self._pending_freed: list[int] = []  # for the next plan's freed_seq_ids
        self._pending_tokens: dict[int, int] = {}  # for the next plan's appended_tokens
        self._pending_copies: list[tuple[int, int]] = []  # for the next plan's copied_blocks
        self._pending_accepted: dict[int, list[int]] = {}  # the next plan's accepted_tokens
        self._pending_lens: dict[int, int] = {}  # the next plan's block_table_lens
        spec = config.speculative
        if spec is not None and spec.method == "draft" and drafter is None:
            raise ValueError(f"speculative {spec} needs its draft engine's drafter")
        if drafter is None and spec is not None:
            drafter = NgramDrafter(spec.num_tokens)
        self.drafter: Drafter | None = drafter
        # K per sequence (runtime/core/spec_policy.py); None: K whenever the drafter matches.
        self.spec_policy = (AdaptivePolicy(SpecCost(config.spec_token_cost,
                                                    config.spec_verify_cost),
                                           config.spec_max_batch_size)
                            if spec is not None and config.spec_adaptive else None)
        self._inflight: StepPlan | None = None
        self._next_arrival = 0
        self._step_id = 0
        self._preemptions = 0
        self._tokens_last_step = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._cache_queries = 0
        self._cache_hits = 0
        self._prompt_computed = 0
        self._forked = 0
        self._copied = 0
        self._rows_reclaimed = 0  # siblings preempted so a request under its share got a row
        self._spec_drafted = 0  # draft tokens verified
        self._spec_accepted = 0  # of those, accepted
        self._spec_drafts = 0  # verify entries
        self._spec_per_pos = [0] * (spec.num_tokens if spec is not None else 0)

    # ---- requests ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; ValueError if it is malformed or can never be served."""
        cfg = self.config
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already scheduled")
        if seq.status is not SeqStatus.WAITING or seq.output_token_ids or seq.block_ids:
            raise ValueError(f"sequence {seq.seq_id} is not fresh")
        n_prompt = seq.num_prompt_tokens
        if n_prompt == 0:
            raise ValueError("the prompt must contain at least one token")
        # The context-length limit is runtime/core/limits.py's (the HTTP layer applies it first).
        output_budget(n_prompt, seq.params.max_tokens, seq.params.min_tokens, cfg.max_seq_len)
        total = n_prompt + seq.params.max_tokens
        # The last sampled token is never computed, so the KV cache holds at most total - 1.
        need = self.block_manager.blocks_needed(total - 1)
        if need > self.block_manager.num_usable:
            raise ValueError(
                f"prompt + max_tokens needs {need} KV blocks, but the cache has only "
                f"{self.block_manager.num_usable}; lower max_tokens or shorten the prompt"
            )
        n_seqs = seq.params.num_sequences
        if n_seqs > cfg.max_batch_size:
            raise ValueError(
                f"{n_seqs} sequences per request (n/best_of) exceed the engine's batch size "
                f"({cfg.max_batch_size})"
            )
        seq.num_computed_tokens = 0
        seq.arrival = self._next_arrival
        seq.fork_pending = n_seqs > 1
        seq.fork_rows = 1
        seq.want_prompt_logits = seq.params.prompt_logprobs is not None and n_prompt > 1
        self._next_arrival += 1
        self._stop_ids[seq.seq_id] = frozenset(
            stop_ids(cfg.eos_token_ids, seq.params.stop_token_ids, seq.params.ignore_eos))
        self._seqs[seq.seq_id] = seq
        insort(self._waiting, seq, key=schedule_order)

    def stop_token_ids(self, seq_id: int) -> frozenset[int]:
        return self._stop_ids[seq_id]

    def abort(self, seq_id: int, reason: FinishReason = "cancelled") -> bool:
        """Finish an unfinished sequence now and free its blocks; False if there is none."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def get(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    # ---- steps -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Decide the next step. Every plan must reach the runners, even an empty one."""
        if self._inflight is not None:
            raise RuntimeError(f"schedule() before update() of step {self._inflight.step_id}")
        bm, cfg = self.block_manager, self.config
        plan = StepPlan(step_id=self._step_id)
        budget = cfg.max_num_tokens
        rows_left = cfg.logit_rows
        preempted = False
        # Prompt tokens left for this step: capped while any running sequence decodes.
        cap = cfg.max_prefill_tokens_while_decoding
        decoding = cap is not None and any(s.num_uncomputed_tokens == 1 for s in self._running)
        prefill_left = cap if decoding and cap is not None else budget

        # Fair shares: every request present may hold max_batch_size // requests rows.
        held = self._rows_held()
        share = max(1, cfg.max_batch_size // len({s.request_id for s in self._seqs.values()}
                                                 or {""}))
        slots = sum(held.values())
        if self._waiting:
            slots = self._make_room(held, share, slots)
        reserve, reserve_priority = self._reserve_for_waiting(prefill_left, held, share, slots)

        # Prompt tokens running chunks may still take in a step that admits a newcomer
        # (None: no cap): the step, and so the newcomer's first token, stays short.
        wait_cap = cfg.max_prefill_tokens_while_waiting if reserve else None

        decodes_left = sum(1 for s in self._running if s.num_uncomputed_tokens == 1)
        # Each decoding sequence's most drafts this step (the adaptive policy asked once),
        # and the drafter told which sequences draft (a draft engine drafts them in one batch).
        step_k = self._prepare_drafts(decodes_left) if self.drafter is not None else {}
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            drafts: list[int] = []
            if num_new == 1 and seq.num_uncomputed_tokens == 1:
                decodes_left -= 1
                # Drafts leave a token for every later decode and the waiting's reserve.
                drafts = self._draft(seq, step_k.get(seq.seq_id, 0),
                                     budget - 1 - decodes_left - reserve,
                                     rows_left - 1 - (len(self._running) - i - 1))
                num_new += len(drafts)
            capped = False  # a chunk that counts against wait_cap
            if num_new > 1 and not drafts:  # a prompt chunk (or a restarted sequence's recompute)
                limit = prefill_left
                if reserve and seq.params.priority >= reserve_priority:
                    # Left for the waiting (after the decodes): their first tokens come now.
                    limit = min(limit, budget - decodes_left) - reserve
                    if wait_cap is not None:
                        limit = min(limit, wait_cap)
                        capped = True
                num_new = min(num_new, limit)
                if num_new < 1:
                    i += 1
                    continue
            if seq.want_prompt_logits:
                # Leave one row for every later running sequence (each may sample).
                num_new = min(num_new, rows_left - (len(self._running) - i - 1))
                if num_new < 1:
                    i += 1
                    continue
            need = bm.blocks_needed(seq.num_computed_tokens + num_new) - len(seq.block_ids)
            if drafts and not bm.can_allocate(need):  # drafts never cost anyone their blocks
                num_new -= len(drafts)
                drafts = []
                need = bm.blocks_needed(seq.num_computed_tokens + num_new) - len(seq.block_ids)
            while not bm.can_allocate(need):
                victim = self._running.pop()  # the last in schedule order
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it preempted itself, and it was the last one
            new_blocks = bm.allocate(need)
            seq.block_ids.extend(new_blocks)
            if seq.seq_id in self._fresh_forks:  # the runners learn it now, table and all
                self._fresh_forks.discard(seq.seq_id)
                plan.new_seqs.append(NewSeq(seq.seq_id, seq.token_ids))
                self._known_to_runners.add(seq.seq_id)
                new_blocks = list(seq.block_ids)
            entry = self._entry(seq, num_new, new_blocks, drafts)
            plan.scheduled.append(entry)
            rows_left -= entry.sample + entry.prompt_logits + len(drafts)
            budget -= num_new
            if num_new > 1 and not drafts:
                prefill_left -= num_new
            if capped and wait_cap is not None:
                wait_cap -= num_new
            i += 1

        while (
            not preempted
            and self._waiting
            and budget > 0
            and prefill_left > 0
            and rows_left > 0
            and slots < cfg.max_batch_size
        ):
            at = self._pick(held, share)
            seq = self._waiting[at]
            hits = self._prefix_hits(seq) if bm.enable_prefix_caching else []
            num_cached = len(hits) * bm.block_size
            num_new = min(seq.num_tokens - num_cached, budget, prefill_left)
            if seq.want_prompt_logits:
                num_new = min(num_new, rows_left)
            need = bm.blocks_needed(num_cached + num_new) - len(hits)
            hits_in_free_list = sum(1 for b in hits if bm.ref_count(b) == 0)
            if bm.num_free - hits_in_free_list < need:
                break  # nobody overtakes the sequence whose turn it is
            del self._waiting[at]
            for block_id in hits:
                bm.acquire(block_id)
            if bm.enable_prefix_caching:
                self._cache_queries += seq.num_tokens
                self._cache_hits += num_cached
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            seq.block_ids = hits + bm.allocate(need)
            seq.num_registered_blocks = len(hits)
            seq.num_computed_tokens = num_cached
            seq.status = SeqStatus.RUNNING
            if seq.fork_pending:  # rows for its siblings: what is free, within its share
                mine = held.get(seq.request_id, 0)
                seq.fork_rows = max(1, min(seq.params.num_sequences,
                                           cfg.max_batch_size - slots, share - mine))
            insort(self._running, seq, key=schedule_order)
            slots += self._slots(seq)
            held[seq.request_id] = held.get(seq.request_id, 0) + self._slots(seq)
            # A restarted sequence carries its output too: recomputing the last known token
            # samples the next new one, so it needs no appended token.
            plan.new_seqs.append(NewSeq(seq.seq_id, seq.token_ids))
            self._known_to_runners.add(seq.seq_id)
            entry = self._entry(seq, num_new, list(seq.block_ids))
            plan.scheduled.append(entry)
            rows_left -= entry.sample + entry.prompt_logits
            budget -= num_new
            prefill_left -= num_new

        plan.freed_seq_ids = self._pending_freed
        self._pending_freed = []
        plan.appended_tokens = self._pending_tokens
        self._pending_tokens = {}
        plan.copied_blocks = self._pending_copies
        self._pending_copies = []
        plan.accepted_tokens = self._pending_accepted
        self._pending_accepted = {}
        plan.block_table_lens = self._pending_lens
        self._pending_lens = {}
        self._inflight = plan
        self._step_id += 1
        self._tokens_last_step = plan.num_tokens
        for entry in plan.scheduled:
            seq = self._seqs[entry.seq_id]
            start = entry.num_computed_tokens
            self._prompt_computed += max(0, min(start + entry.num_new_tokens,
                                                seq.num_prompt_tokens) - start)
        return plan

    def update(self, plan: StepPlan, sampled: Mapping[int, int],
               forks: Mapping[int, Seq[tuple[int, int]]] | None = None,
               accepted: Mapping[int, Seq[int]] | None = None) -> list[Sequence]:
        """Record a finished step: `sampled` maps seq id -> token for each `sample` entry;
        `forks` maps a sequence that sampled its first token and has `fork_pending` to its
        siblings' (new seq id, first token); `accepted` maps a sequence that verified
        drafts to the prefix of them it keeps (absent: none), which come before its
        sampled token.

        Returns the sequences that got a token or finished this step (new siblings
        included, right after their parent); finished ones have `finish_reason` set,
        have released their blocks, and are no longer tracked. Tokens for sequences
        aborted while the step ran are ignored.
        """
        if plan is not self._inflight:
            raise RuntimeError(f"update() for step {plan.step_id}, which is not in flight")
        sample_ids = {s.seq_id for s in plan.scheduled if s.sample}
        extra = sampled.keys() - sample_ids
        if extra:
            raise ValueError(f"sampled tokens for sequences the plan did not sample: {extra}")
        missing = {i for i in sample_ids - sampled.keys() if i in self._seqs}
        if missing:
            raise ValueError(f"no sampled token for sequences {missing}")
        accepted = accepted or {}
        drafts = {s.seq_id: s.draft_token_ids for s in plan.scheduled if s.draft_token_ids}
        for sid, kept in accepted.items():
            if list(kept) != drafts.get(sid, [])[:len(kept)] or sid not in drafts:
                raise ValueError(f"accepted tokens for sequence {sid} are not a prefix of "
                                 f"its drafts")
        self._inflight = None
        out: list[Sequence] = []
        for entry in plan.scheduled:
            seq = self._seqs.get(entry.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            if not entry.draft_token_ids:
                seq.num_computed_tokens = entry.num_computed_tokens + entry.num_new_tokens
            elif not self._verified(seq, entry, accepted.get(seq.seq_id, ())):
                out.append(seq)  # it finished among its accepted drafts
                continue
            if self.block_manager.enable_prefix_caching:
                self._register_full_blocks(seq)
            if seq.num_computed_tokens >= seq.num_prompt_tokens - 1:
                seq.want_prompt_logits = False
            if not entry.sample:
                continue
            token = sampled[seq.seq_id]
            children: list[Sequence] = []
            if seq.fork_pending:
                seq.fork_pending = False
                children = self._fork(seq, (forks or {}).get(seq.seq_id, ()))
            if self._append(seq, token) is None:
                self._pending_tokens[seq.seq_id] = token
            out.append(seq)
            out.extend(children)
        return out

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_blocks_used=self.block_manager.num_used,
            kv_blocks_total=self.block_manager.num_usable,
            kv_blocks_cached=self.block_manager.num_cached_free,
            preemptions_total=self._preemptions,
            steps_total=self._step_id,
            tokens_last_step=self._tokens_last_step,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            prefix_cache_queries_total=self._cache_queries,
            prefix_cache_hits_total=self._cache_hits,
            prompt_tokens_computed_total=self._prompt_computed,
            forked_sequences_total=self._forked,
            kv_blocks_copied_total=self._copied,
            rows_reclaimed_total=self._rows_reclaimed,
            spec_draft_tokens_total=self._spec_drafted,
            spec_accepted_tokens_total=self._spec_accepted,
            spec_drafts_total=self._spec_drafts,
            spec_accepted_per_pos=tuple(self._spec_per_pos),
            spec_backoffs_total=(self.spec_policy.backoffs_total
                                 if self.spec_policy is not None else 0),
        )

    # ---- internals ---------------------------------------------------------------------

    def _slots(self, seq: Sequence) -> int:
        """Batch rows a sequence holds: its own, plus its siblings' until it forks."""
        return seq.fork_rows if seq.fork_pending else 1

    def _rows_held(self) -> dict[str, int]:
        """Batch rows each request's running sequences hold."""
        held: dict[str, int] = {}
        for seq in self._running:
            held[seq.request_id] = held.get(seq.request_id, 0) + self._slots(seq)
        return held

    def _pick(self, held: Mapping[str, int], share: int) -> int:
        """Where in the queue the next sequence to admit is: among those of the best
        priority waiting, the first whose request holds fewer rows than its share; else
        the head (rows are free and nobody else wants them)."""
        best = self._waiting[0].params.priority
        for at, seq in enumerate(self._waiting):
            if seq.params.priority != best:
                break
            if held.get(seq.request_id, 0) < share:
                return at
        return 0

    def _make_room(self, held: dict[str, int], share: int, slots: int) -> int:
        """A request under its share waits and every row is taken: take rows back from
        requests over theirs (none more important than it), one at a time, the most over
        first. A sibling reservation shrinks first (free); else that request's last
        sibling is preempted, to be recomputed when rows are free again. Returns the rows
        held now."""
        want = self._waiting[self._pick(held, share)]
        if held.get(want.request_id, 0) >= share:
            return slots
        by_request: dict[str, list[Sequence]] = {}
        for seq in self._running:
            by_request.setdefault(seq.request_id, []).append(seq)
        while slots >= self.config.max_batch_size:
            over = [r for r, seqs in by_request.items() if held[r] > share
                    and seqs[0].params.priority >= want.params.priority]
            if not over:
                break
            r = max(over, key=lambda r: (held[r] - share, schedule_order(by_request[r][0])))
            seqs = by_request[r]
            pending = next((s for s in seqs if s.fork_pending and s.fork_rows > 1), None)
            if pending is not None:
                pending.fork_rows -= 1
            else:
                victim = seqs.pop()  # held > share >= 1 leaves its first one running
                self._running.remove(victim)
                self._preempt(victim)
                self._rows_reclaimed += 1
            held[r] -= 1
            slots -= 1
        return slots

    def _reserve_for_waiting(self, prefill_left: int, held: Mapping[str, int], share: int,
                             slots: int) -> tuple[int, int]:
        """Prompt tokens kept from running prompts this step for the sequences whose turn
        it is to be admitted (as many as rows are free; at most half the step's prompt
        tokens, so that both progress), and the priority that may claim them: a long
        prompt being prefilled no longer holds back the first token of every request
        that arrives after it."""
        free_rows = self.config.max_batch_size - slots
        if not self._waiting or free_rows < 1 or prefill_left < 2:
            return 0, 0
        at = self._pick(held, share)
        want = self._waiting[at]
        demand = want.num_tokens
        for seq in self._waiting[:free_rows + 1]:
            if seq is not want and seq.params.priority == want.params.priority:
                demand += seq.num_tokens
        reserve = min(prefill_left // 2, demand)
        if self.block_manager.num_free < self.block_manager.blocks_needed(
                min(reserve, want.num_tokens)):
            return 0, 0  # its turn cannot come this step anyway
        return reserve, want.params.priority

    def _prepare_drafts(self, batch: int) -> dict[int, int]:
        """Once per step, before the scheduling loop: the most drafts each decoding sequence
        may verify (none unless it may speculate; at most K, or what the adaptive policy
        allows it among `batch` decoding sequences, asked once per decode step; one fewer
        than the tokens max_tokens still allows, as a verify step yields up to K + 1), and
        the drafter told which sequences draft (a draft engine drafts them all in one batch;
        `_draft` then takes what the step's budget allows)."""
        assert self.drafter is not None
        out: dict[int, int] = {}
        candidates = []
        for seq in self._running:
            if seq.num_uncomputed_tokens != 1 or not speculable(
                    seq.params, seq.num_output_tokens, bool(self._stop_ids[seq.seq_id])):
                continue
            k = min(self.drafter.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
            if self.spec_policy is not None:
                # Asked before the drafter: a sequence that does not draft costs no lookup.
                k = self.spec_policy.k_for(seq.seq_id, k, batch)
            if k > 0:
                out[seq.seq_id] = k
                candidates.append((seq.seq_id, seq.token_ids, k))
        self.drafter.prepare(candidates)
        return out

    def _draft(self, seq: Sequence, k: int, tokens_left: int, rows_left: int) -> list[int]:
        """Drafts to verify after a decoding sequence's last token: at most its `k` this
        step (`_prepare_drafts`), the tokens and logits rows the step can spare."""
        k = min(k, tokens_left, rows_left)
        if self.drafter is None or k < 1:
            return []
        drafts = self.drafter.propose(seq.token_ids, k, seq.seq_id)
        if not drafts and self.spec_policy is not None:
            self.spec_policy.no_draft(seq.seq_id)
        return drafts

    def _verified(self, seq: Sequence, entry: ScheduledSeq, kept: Seq[int]) -> bool:
        """A verify step's rollback and its accepted drafts: computed tokens up to the last
        accepted one, the blocks beyond them freed (tail first), the drafts appended one
        by one. False if one of them ended the sequence."""
        self._spec_drafted += len(entry.draft_token_ids)
        self._spec_accepted += len(kept)
        self._spec_drafts += 1
        for pos in range(len(kept)):
            self._spec_per_pos[pos] += 1
        if self.spec_policy is not None:
            self.spec_policy.observe(seq.seq_id, len(entry.draft_token_ids), len(kept))
        seq.num_computed_tokens = entry.num_computed_tokens + 1 + len(kept)
        keep = self.block_manager.blocks_needed(seq.num_computed_tokens)
        if len(seq.block_ids) > keep:
            self.block_manager.free(reversed(seq.block_ids[keep:]))
            del seq.block_ids[keep:]
            self._pending_lens[seq.seq_id] = keep
        for token in kept:
            if self._append(seq, token) is not None:
                return False
        if kept:
            self._pending_accepted[seq.seq_id] = list(kept)
        return True

    def _entry(self, seq: Sequence, num_new: int, new_blocks: list[int],
               drafts: list[int] | None = None) -> ScheduledSeq:
        start = seq.num_computed_tokens
        rows = 0
        if seq.want_prompt_logits:  # positions whose next token is a prompt token
            rows = max(0, min(start + num_new, seq.num_prompt_tokens - 1) - start)
        return ScheduledSeq(
            seq_id=seq.seq_id,
            num_computed_tokens=start,
            num_new_tokens=num_new,
            new_block_ids=new_blocks,
            sample=start + num_new - len(drafts or ()) == seq.num_tokens,
            prompt_logits=rows,
            draft_token_ids=drafts or [],
        )

    # ---- state changes ------------------------------------------------------------------

    def _append(self, seq: Sequence, token: int) -> FinishReason | None:
        """A sampled token joins the sequence; finishes it on a stop token or at max_tokens."""
        seq.output_token_ids.append(token)
        self._generation_tokens += 1
        if seq.num_output_tokens == 1:
            self._prompt_tokens += seq.num_prompt_tokens
        if token in self._stop_ids[seq.seq_id]:
            reason: FinishReason | None = "stop"
        elif seq.num_output_tokens >= seq.params.max_tokens:
            reason = "length"
        else:
            return None
        self._finish(seq, reason)
        return reason

    def _fork(self, parent: Sequence, children: Seq[tuple[int, int]]) -> list[Sequence]:
        """Siblings of `parent`, which has just computed its prompt, each with its token.

        A sibling shares the full prompt blocks and gets its own copy of the partly filled
        last one. Only `parent.fork_rows - 1` siblings start running (the rows the request
        was given at admission, its fair share at most); the others, and any for which no
        block is free for that copy, wait holding nothing and are recomputed when admitted
        (the prefix cache may still serve the full blocks)."""
        bm, bs = self.block_manager, self.config.block_size
        length = parent.num_computed_tokens  # == its prompt: it forks at its first sample
        full, partial = divmod(length, bs)
        out: list[Sequence] = []
        rows = parent.fork_rows - 1
        for child_id, token in children:
            if child_id in self._seqs:
                raise ValueError(f"sequence id {child_id} is already scheduled")
            child = Sequence(child_id, parent.request_id, parent.prompt_token_ids, parent.params)
            child.arrival = parent.arrival
            child.num_cached_tokens = max(0, parent.num_cached_tokens)
            child.block_hashes = list(parent.block_hashes[:full])
            self._seqs[child_id] = child
            self._stop_ids[child_id] = self._stop_ids[parent.seq_id]
            self._forked += 1
            if rows > 0 and bm.can_allocate(1 if partial else 0):
                rows -= 1
                for block_id in parent.block_ids[:full]:
                    bm.share(block_id)
                child.block_ids = parent.block_ids[:full] + bm.allocate(1 if partial else 0)
                if partial:
                    self._pending_copies.append((parent.block_ids[full], child.block_ids[full]))
                    self._copied += 1
                child.num_computed_tokens = length
                child.num_registered_blocks = min(parent.num_registered_blocks, full)
                child.status = SeqStatus.RUNNING
                insort(self._running, child, key=schedule_order)
                self._fresh_forks.add(child_id)
            else:
                insort(self._waiting, child, key=schedule_order)
            # The token counts as sampled now; a waiting sibling recomputes it on admission.
            self._append(child, token)
            out.append(child)
        return out

    def _release(self, seq: Sequence) -> None:
        # Last block first: the tail is the least likely to be a shared prefix, so it
        # should be the first evicted from the prefix cache.
        self.block_manager.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_registered_blocks = 0
        self._pending_tokens.pop(seq.seq_id, None)
        self._pending_accepted.pop(seq.seq_id, None)
        self._pending_lens.pop(seq.seq_id, None)
        self._fresh_forks.discard(seq.seq_id)
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)
        if seq.seq_id in self._known_to_runners:
            self._known_to_runners.remove(seq.seq_id)
            self._pending_freed.append(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        insort(self._waiting, seq, key=schedule_order)
        self._preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Out of its queue, its blocks released, finished with `reason`."""
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.fork_pending = False
        seq.fork_rows = 1
        if self.spec_policy is not None:
            self.spec_policy.forget(seq.seq_id)
        del self._seqs[seq.seq_id]
        del self._stop_ids[seq.seq_id]

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix-cache keys of the first `num_blocks` full blocks (computed lazily)."""
        bs = self.config.block_size
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            tokens = seq.token_ids
            for i in range(len(hashes), num_blocks):
                parent = hashes[i - 1] if i else None
                hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        if seq.want_prompt_logits:
            return []  # every prompt position must be computed to yield its logits
        bs = self.config.block_size
        # At least one token must be computed, so that the step yields logits to sample.
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = self._block_hashes(seq, max_blocks)
        tokens = seq.token_ids
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.block_manager.cached_block(hashes[i], tokens[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.config.block_size
        num_full = seq.num_computed_tokens // bs
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        tokens = seq.token_ids
        for i in range(seq.num_registered_blocks, num_full):
            self.block_manager.register(seq.block_ids[i], hashes[i], tokens[i * bs : (i + 1) * bs])
        seq.num_registered_blocks = num_full
