"""Iteration-level scheduler: one `StepPlan` per step, in the style of vLLM v1.

There are no prefill and decode phases. Every sequence has known tokens (prompt + output)
and computed tokens (in the KV cache); each step hands out a token budget so that computed
catches up with known. A long prompt is computed over several steps (chunked prefill), a
decode is one token (the one sampled last step), and both share a step.

Per step: running sequences first, in arrival order, each taking min(uncomputed, budget
left) tokens; then waiting sequences, first come first served, while the batch has room,
budget is left and the KV blocks for their first chunk are free. Blocks are allocated for
exactly the tokens computed this step. When a running sequence needs a block and none is
free, the most recently arrived running sequence (maybe itself) is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed from prompt + output
when readmitted. No sequence is admitted in a step that preempted.

Liveness: the oldest running sequence is never preempted for another one, and `add`
rejects what could not fit in the pool alone, so the oldest always progresses.

Call order: `schedule()`, run the plan on every rank, `update(plan, sampled)`, repeat;
`add` and `abort` go between steps. Not thread-safe: the engine loop serialises calls.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from dataclasses import dataclass

from runtime.kv_cache import BlockManager, hash_block
from runtime.plan import NewSeq, ScheduledSeq, StepPlan
from runtime.sequence import SeqStatus, Sequence
from runtime.types import FinishReason


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int  # sequences holding KV blocks (running) at once
    max_num_tokens: int  # tokens computed per step, over all sequences
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the pool, the null block included
    max_seq_len: int  # prompt + max_tokens limit per request
    eos_token_ids: tuple[int, ...] = ()
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "block_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least max_batch_size "
                f"({self.max_batch_size}) so that every running sequence can decode in one step"
            )
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is the null block), "
                f"got {self.num_blocks!r}"
            )
        if not isinstance(self.eos_token_ids, tuple) or not all(
            isinstance(t, int) and t >= 0 for t in self.eos_token_ids
        ):
            raise ValueError(
                f"eos_token_ids must be a tuple of non-negative ints, got {self.eos_token_ids!r}"
            )


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    running: int
    waiting: int
    kv_blocks_used: int  # held by unfinished sequences
    kv_blocks_total: int  # usable blocks (the null block excluded)
    kv_blocks_cached: int  # prefix-cached blocks no sequence holds (free, reusable)
    preemptions_total: int
    steps_total: int
    tokens_last_step: int
    prompt_tokens_total: int  # prompts of sequences that produced their first token
    generation_tokens_total: int  # tokens sampled
    prefix_cache_queries_total: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int  # of those, tokens found (not computed again)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self._waiting: deque[Sequence] = deque()  # arrival order (preempted ones rejoin at front)
        self._running: list[Sequence] = []  # arrival order
        self._stop_ids: dict[int, frozenset[int]] = {}
        self._known_to_runners: set[int] = set()
        self._pending_freed: list[int] = []  # for the next plan's freed_seq_ids
        self._pending_tokens: dict[int, int] = {}  # for the next plan's appended_tokens
        self._inflight: StepPlan | None = None
        self._next_arrival = 0
        self._step_id = 0
        self._preemptions = 0
        self._tokens_last_step = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._cache_queries = 0
        self._cache_hits = 0

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
        total = n_prompt + seq.params.max_tokens
        if total > cfg.max_seq_len:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({seq.params.max_tokens}) = {total} "
                f"exceeds the engine's max_seq_len ({cfg.max_seq_len})"
            )
        # The last sampled token is never computed, so the KV cache holds at most total - 1.
        need = self.block_manager.blocks_needed(total - 1)
        if need > self.block_manager.num_usable:
            raise ValueError(
                f"prompt + max_tokens needs {need} KV blocks, but the cache has only "
                f"{self.block_manager.num_usable}; lower max_tokens or shorten the prompt"
            )
        seq.num_computed_tokens = 0
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        stop = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            stop.update(cfg.eos_token_ids)
        self._stop_ids[seq.seq_id] = frozenset(stop)
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)

    def abort(self, seq_id: int, reason: FinishReason = "cancelled") -> bool:
        """Finish an unfinished sequence now and free its blocks; False if there is none."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
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
        bm = self.block_manager
        plan = StepPlan(step_id=self._step_id)
        budget = self.config.max_num_tokens
        preempted = False

        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            need = bm.blocks_needed(seq.num_computed_tokens + num_new) - len(seq.block_ids)
            while not bm.can_allocate(need):
                victim = self._running.pop()  # the most recently arrived
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it preempted itself, and it was the last one
            new_blocks = bm.allocate(need)
            seq.block_ids.extend(new_blocks)
            plan.scheduled.append(self._entry(seq, num_new, new_blocks))
            budget -= num_new
            i += 1

        while (
            not preempted
            and self._waiting
            and budget > 0
            and len(self._running) < self.config.max_batch_size
        ):
            seq = self._waiting[0]
            hits = self._prefix_hits(seq) if bm.enable_prefix_caching else []
            num_cached = len(hits) * bm.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            need = bm.blocks_needed(num_cached + num_new) - len(hits)
            hits_in_free_list = sum(1 for b in hits if bm.ref_count(b) == 0)
            if bm.num_free - hits_in_free_list < need:
                break  # first come, first served: nobody overtakes the head of the queue
            self._waiting.popleft()
            for block_id in hits:
                bm.acquire(block_id)
            if bm.enable_prefix_caching:
                self._cache_queries += seq.num_tokens
                self._cache_hits += num_cached
            seq.block_ids = hits + bm.allocate(need)
            seq.num_registered_blocks = len(hits)
            seq.num_computed_tokens = num_cached
            seq.status = SeqStatus.RUNNING
            insort(self._running, seq, key=_arrival)
            # A restarted sequence carries its output too: recomputing the last known token
            # samples the next new one, so it needs no appended token.
            plan.new_seqs.append(NewSeq(seq.seq_id, seq.token_ids))
            self._known_to_runners.add(seq.seq_id)
            plan.scheduled.append(self._entry(seq, num_new, list(seq.block_ids)))
            budget -= num_new

        plan.freed_seq_ids = self._pending_freed
        self._pending_freed = []
        plan.appended_tokens = self._pending_tokens
        self._pending_tokens = {}
        self._inflight = plan
        self._step_id += 1
        self._tokens_last_step = plan.num_tokens
        return plan

    def update(self, plan: StepPlan, sampled: dict[int, int]) -> list[Sequence]:
        """Record a finished step: `sampled` maps seq id -> token for each `sample` entry.

        Returns the sequences that got a token or finished this step; finished ones have
        `finish_reason` set, have released their blocks, and are no longer tracked.
        Tokens for sequences aborted while the step ran are ignored.
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
        self._inflight = None
        out: list[Sequence] = []
        for entry in plan.scheduled:
            seq = self._seqs.get(entry.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            seq.num_computed_tokens = entry.num_computed_tokens + entry.num_new_tokens
            if self.block_manager.enable_prefix_caching:
                self._register_full_blocks(seq)
            if not entry.sample:
                continue
            token = sampled[seq.seq_id]
            seq.output_token_ids.append(token)
            self._generation_tokens += 1
            if seq.num_output_tokens == 1:
                self._prompt_tokens += seq.num_prompt_tokens
            if token in self._stop_ids[seq.seq_id]:
                reason: FinishReason | None = "stop"
            elif seq.num_output_tokens >= seq.params.max_tokens:
                reason = "length"
            else:
                reason = None
            if reason is None:
                self._pending_tokens[seq.seq_id] = token
            else:
                self._running.remove(seq)
                self._finish(seq, reason)
            out.append(seq)
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
        )

    # ---- internals ---------------------------------------------------------------------

    def _entry(self, seq: Sequence, num_new: int, new_blocks: list[int]) -> ScheduledSeq:
        return ScheduledSeq(
            seq_id=seq.seq_id,
            num_computed_tokens=seq.num_computed_tokens,
            num_new_tokens=num_new,
            new_block_ids=new_blocks,
            sample=seq.num_computed_tokens + num_new == seq.num_tokens,
        )

    def _release(self, seq: Sequence) -> None:
        # Last block first: the tail is the least likely to be a shared prefix, so it
        # should be the first evicted from the prefix cache.
        self.block_manager.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_registered_blocks = 0
        self._pending_tokens.pop(seq.seq_id, None)
        if seq.seq_id in self._known_to_runners:
            self._known_to_runners.remove(seq.seq_id)
            self._pending_freed.append(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self._waiting.appendleft(seq)
        self._preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
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


def _arrival(seq: Sequence) -> int:
    return seq.arrival
