"""LLMEngine: the torch executor (rank 0) and the worker loop (every other rank).

Rank 0's engine loop runs on the main thread: it takes requests from a thread-safe inbox,
schedules a step, sends the plan to the other ranks, runs its own shard, samples, and
hands each request's new tokens to its callback. The HTTP thread only enqueues and
cancels; it never waits for model compute.

A request is a group of sequences (runtime/core/requests.py): one, or n/best_of that fork
from the first when it samples its first token.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from runtime.core.grammar import GrammarState
from runtime.core.logits import SeqSampling
from runtime.core.plan import StepPlan
from runtime.core.requests import Group, RequestTable
from runtime.core.sampler import Sampler, make_generator
from runtime.core.scheduler import Scheduler, SchedulerConfig
from runtime.core.scheduler_config import SPEC_PER_POS
from runtime.core.sequence import Sequence
from runtime.core.spec import Drafter
from runtime.core.thread_policy import ThreadPolicy
from runtime.core.types import (
    EventCallback,
    ExecutorStats,
    FinishReason,
    SamplingParams,
    TokenEvent,
    UnsupportedParameter,
)
from runtime.dist.comm import Comm
from runtime.executors.runner import ModelRunner
from runtime.runqueue import RunQueueClock

# At DEBUG, one line per request queued and per step (which sequences, how many tokens,
# how long): enough to see when a request is added and in which step it is admitted.
log = logging.getLogger(__name__)


class LLMEngine:
    """Implements `runtime.core.types.Executor` over our scheduler and model runner."""

    def __init__(self, runner: ModelRunner, config: SchedulerConfig, comm: Comm | None = None,
                 drafter: Drafter | None = None, threads: ThreadPolicy | None = None) -> None:
        """`drafter`: a draft engine's (runtime/executors/draft.py) for speculative
        `draft:ENGINE`; rank 0 runs it between steps, the other ranks never see it.
        `threads`: how many intra-op threads each step runs with, from what the steps
        measure (runtime/core/thread_policy.py); None keeps the process's count."""
        self.runner = runner
        self.threads = threads
        # What the stepping thread waits on a run queue during each step: the policy's
        # direct sign of contention (read on the engine thread; ~1 µs a read).
        self._run_queue = RunQueueClock() if threads is not None else None
        self.drafter = drafter
        self.scheduler = Scheduler(config, drafter)
        self.sampler = Sampler()
        self.comm = comm
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.requests = RequestTable()
        self._unfinished = 0
        self._lock = threading.Lock()
        self._stats = ExecutorStats(kv_blocks_total=self.scheduler.block_manager.num_usable)
        # Steps and their seconds, decode-only steps apart from those with prompt tokens:
        # Δseconds / Δsteps between two scrapes is the step time the server sees.
        self._step_time = {f"{kind}_{what}_total": 0.0 for kind in ("decode", "prefill")
                           for what in ("steps", "step_seconds")}

    # ---- Executor interface (thread-safe) ---------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        on_event: EventCallback,
    ) -> None:
        limit = self.scheduler.config.max_batch_size
        if params.num_sequences > limit:
            raise UnsupportedParameter("num_sequences", f"{params.num_sequences} sequences per "
                                       f"request exceed this engine's batch size ({limit})")
        if params.guided is not None and params.grammar is None:
            raise UnsupportedParameter("response_format", "the grammar was not compiled "
                                       "(runtime.core.grammar.GrammarCompiler) before submission")
        with self._lock:
            self._unfinished += 1
        self._inbox.put(("add", (request_id, list(prompt_token_ids), params, on_event)))
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def stats(self) -> ExecutorStats:
        return self._stats

    def num_unfinished(self) -> int:
        return self._unfinished

    def wait_for_work(self, timeout: float) -> None:
        """Block until a request arrives or is cancelled, or `timeout` seconds pass."""
        self._wake.wait(timeout)
        self._wake.clear()

    # ---- engine loop (one thread) -----------------------------------------------------

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._admit(*payload)  # type: ignore[misc]
            else:
                group = self.requests.groups.get(payload)  # type: ignore[arg-type]
                if group is not None:
                    self._end_group(group, "cancelled")

    def _reject(self, request_id: str, prompt: list[int], cb: EventCallback, why: str) -> None:
        with self._lock:
            self._unfinished -= 1
        cb(TokenEvent(request_id, [], "rejected", len(prompt), error=why))

    def _admit(self, request_id: str, prompt: list[int], params: SamplingParams, cb: EventCallback) -> None:
        if request_id in self.requests.groups:
            self._reject(request_id, prompt, cb, f"request id {request_id} is already running")
            return
        sid = self.requests.next_id()
        seq = Sequence(sid, request_id, prompt, params)
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            self._reject(request_id, prompt, cb, str(e))
            return
        stop = self.scheduler.stop_token_ids(sid)
        grammar = None
        if params.grammar is not None:
            if not stop:
                self.scheduler.abort(sid)
                self._reject(request_id, prompt, cb, "a grammar needs a stop token to end "
                             "the output (ignore_eos is set and there are no stop_token_ids)")
                return
            grammar = GrammarState(params.grammar, sorted(stop))
        sampling = SeqSampling(params, make_generator(params), stop, prompt, grammar)
        self.requests.add(sid, request_id, prompt, params, cb, sampling)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("queued %s as seq %d: %d prompt tokens, before step %d", request_id,
                      sid, len(prompt), self.scheduler.stats().steps_total)

    def _end_group(self, group: Group, reason: FinishReason, error: str | None = None) -> None:
        """End a whole request now (cancel, engine failure): one final event."""
        for sid in group.seq_ids:
            self.scheduler.abort(sid, reason)
        self.requests.remove(group)
        with self._lock:
            self._unfinished -= 1
        group.on_event(TokenEvent(group.request_id, [], reason, len(group.prompt), error=error))

    def step(self) -> StepPlan | None:
        """Run one iteration if there is work; returns the plan it ran."""
        self._drain_inbox()
        if not self.scheduler.has_unfinished():
            # A cancel or a rejection may just have emptied the batch: /metrics must see it.
            self._refresh_stats()
            return None
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.comm is not None:
            self.comm.send_plan(plan)
        if self.threads is not None and (n := self.threads.threads()) != torch.get_num_threads():
            torch.set_num_threads(n)
        waited = self._run_queue.seconds() if self._run_queue is not None else 0.0
        t_exec = time.perf_counter()
        sampled_ids, logits = self.runner.execute(plan)
        t_exec = time.perf_counter() - t_exec
        if self._run_queue is not None:
            waited = self._run_queue.seconds() - waited
        sampled: dict[int, int] = {}
        forks: dict[int, list[tuple[int, int]]] = {}
        accepted: dict[int, list[int]] = {}
        # Rows: sampled ones, then prompt log-probability ones, then draft ones.
        n_sampled = len(sampled_ids)
        n_prompt = sum(s.prompt_logits for s in plan.scheduled)
        if logits is not None and n_prompt:
            self.requests.collect_prompt_logprobs(
                self.sampler, plan, logits[n_sampled:n_sampled + n_prompt])
        if sampled_ids:
            assert logits is not None
            sampled, forks = self.requests.sample(self.sampler, self.scheduler, sampled_ids,
                                                  logits, plan)
            if plan.num_draft_rows:
                accepted = self.requests.verify(self.sampler, plan, sampled_ids, logits,
                                                n_sampled + n_prompt, sampled)
        for seq in self.scheduler.update(plan, sampled, forks, accepted):
            self._emit(seq)
        # A verify step (speculation) decodes too: its drafts are not prompt tokens.
        decoding = plan.num_tokens - plan.num_draft_rows == len(plan.scheduled)
        kind = "decode" if decoding else "prefill"
        if self.threads is not None:
            self.threads.record(t_exec, plan.num_tokens, decoding, waited)
        self._step_time[f"{kind}_steps_total"] += 1
        seconds = time.perf_counter() - t0
        self._step_time[f"{kind}_step_seconds_total"] += seconds
        if log.isEnabledFor(logging.DEBUG):  # "seq:tokens", * where it sampled
            log.debug("step %d: %d tokens in %.3f s [%s]", plan.step_id, plan.num_tokens,
                      seconds, " ".join(f"{s.seq_id}:{s.num_new_tokens}{'*' * s.sample}"
                                        for s in plan.scheduled))
        self._refresh_stats()
        return plan

    def _emit(self, seq: Sequence) -> None:
        group, event = self.requests.event(seq)
        if event.finish_reason is not None and group.request_id not in self.requests.groups:
            with self._lock:
                self._unfinished -= 1
        group.on_event(event)

    def _refresh_stats(self) -> None:
        s = self.scheduler.stats()
        self._stats = ExecutorStats(
            running=s.running, waiting=s.waiting, kv_blocks_total=s.kv_blocks_total,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_cached=s.kv_blocks_cached,
            preemptions_total=s.preemptions_total,
            steps_total=s.steps_total, tokens_last_step=s.tokens_last_step,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            extra={"prefix_cache_hits_total": float(s.prefix_cache_hits_total),
                   "prefix_cache_queries_total": float(s.prefix_cache_queries_total),
                   "prompt_tokens_computed_total": float(s.prompt_tokens_computed_total),
                   "forked_sequences_total": float(s.forked_sequences_total),
                   "kv_blocks_copied_total": float(s.kv_blocks_copied_total),
                   "spec_decode_num_draft_tokens_total": float(s.spec_draft_tokens_total),
                   "spec_decode_num_accepted_tokens_total":
                       float(s.spec_accepted_tokens_total),
                   "spec_decode_num_drafts_total": float(s.spec_drafts_total),
                   "spec_decode_backoffs_total": float(s.spec_backoffs_total),
                   # vLLM's per-position counter, one key per draft position
                   **{f"{SPEC_PER_POS}{i}": float(n)
                      for i, n in enumerate(s.spec_accepted_per_pos)},
                   **self._step_time,
                   # The count steps run with, measured or fixed (AOTLLM_THREADS, TP > 1).
                   **(self.threads.as_dict() if self.threads is not None
                      else {"intra_op_threads": float(torch.get_num_threads())})},
        )

    def abort_all(self, reason: FinishReason = "cancelled", error: str | None = None) -> None:
        self._drain_inbox()
        for group in list(self.requests.groups.values()):
            self._end_group(group, reason, error)

    def fail_all(self, why: str) -> None:
        """The engine cannot go on: end every request, queued or running, with an error.
        Called on the engine thread after a failed step; the scheduler's state is not
        trusted any more, so requests are ended directly."""
        self._drain_inbox()
        for group in list(self.requests.groups.values()):
            self.requests.remove(group)
            with self._lock:
                self._unfinished -= 1
            group.on_event(TokenEvent(group.request_id, [], "error", len(group.prompt),
                                      error=why))

    def shutdown_workers(self) -> None:
        if self.comm is not None:
            self.comm.send_plan(StepPlan(step_id=-1, shutdown=True))

    # ---- a synchronous helper (tests, benchmarks) ------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        """Submit all prompts at once and step until every one finishes (sequence 0's
        tokens of each)."""
        out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        done: dict[str, str] = {}

        def cb(ev: TokenEvent) -> None:
            if ev.index == 0:
                out[ev.request_id].extend(ev.token_ids)
            if ev.finish_reason is not None and (ev.index == 0 or ev.finish_reason not in
                                                 ("stop", "length")):
                done[ev.request_id] = ev.error or ev.finish_reason

        for i, (p, sp) in enumerate(zip(prompts, params)):
            self.add_request(str(i), p, sp, cb)
        while self._unfinished:
            self.step()
        errors = [v for v in done.values() if v not in ("stop", "length")]
        if errors:
            raise ValueError(errors[0])
        return [out[str(i)] for i in range(len(prompts))]


def worker_loop(runner: ModelRunner, comm: Comm) -> None:
    """Ranks > 0: execute every plan rank 0 sends until the shutdown plan."""
    while True:
        plan = comm.recv_plan()
        if plan.shutdown:
            return
        runner.execute(plan)
