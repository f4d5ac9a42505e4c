"""The scheduler's state and the operations that change it consistently.

`SchedulerState` holds the sequences (waiting, running), the block manager, what the next
plan must tell the runners (freed sequences, appended tokens, block copies) and the
counters; its methods finish, preempt and fork sequences and keep the prefix cache's
registrations, always leaving blocks, queues and runners' knowledge in agreement.
`Scheduler` (runtime/scheduler.py) decides the steps on top of it.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence as Seq

from runtime.kv_cache import BlockManager, hash_block
from runtime.plan import StepPlan
from runtime.scheduler_config import SchedulerConfig
from runtime.sequence import SeqStatus, Sequence
from runtime.types import FinishReason


def schedule_order(seq: Sequence) -> tuple[int, int]:
    """Both queues' order: priority (lower first, as vLLM's), then arrival. Siblings share
    their parent's key and stay in the order they joined."""
    return (seq.params.priority, seq.arrival)


class SchedulerState:
    def __init__(self, config: SchedulerConfig) -> None:
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
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
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
        self._fresh_forks.discard(seq.seq_id)
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
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.fork_pending = False
        seq.fork_rows = 1
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
