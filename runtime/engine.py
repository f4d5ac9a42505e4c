"""LLMEngine: the torch executor (rank 0) and the worker loop (every other rank).

Rank 0's engine loop runs on the main thread: it takes requests from a thread-safe inbox,
schedules a step, sends the plan to the other ranks, runs its own shard, samples, and
hands each request's new tokens to its callback. The HTTP thread only enqueues and
cancels; it never waits for model compute.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass

from runtime.comm import Comm
from runtime.plan import StepPlan
from runtime.runner import ModelRunner
from runtime.sampler import Sampler, make_generator
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.sequence import Sequence
from runtime.types import EventCallback, ExecutorStats, FinishReason, SamplingParams, TokenEvent


@dataclass(slots=True)
class _Request:
    seq: Sequence
    on_event: EventCallback
    generator: object
    emitted: int = 0


class LLMEngine:
    """Implements `runtime.types.Executor` over our scheduler and model runner."""

    def __init__(self, runner: ModelRunner, config: SchedulerConfig, comm: Comm | None = None) -> None:
        self.runner = runner
        self.scheduler = Scheduler(config)
        self.sampler = Sampler()
        self.comm = comm
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._requests: dict[int, _Request] = {}
        self._by_id: dict[str, int] = {}
        self._ids = itertools.count()
        self._unfinished = 0
        self._lock = threading.Lock()
        self._stats = ExecutorStats(kv_blocks_total=self.scheduler.block_manager.num_usable)

    # ---- Executor interface (thread-safe) ---------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        on_event: EventCallback,
    ) -> None:
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
                sid = self._by_id.get(payload)  # type: ignore[arg-type]
                if sid is not None and self.scheduler.abort(sid):
                    self._finish(sid, "cancelled")

    def _admit(self, request_id: str, prompt: list[int], params: SamplingParams, cb: EventCallback) -> None:
        sid = next(self._ids)
        seq = Sequence(sid, request_id, prompt, params)
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            with self._lock:
                self._unfinished -= 1
            cb(TokenEvent(request_id, [], "rejected", len(prompt), error=str(e)))
            return
        self._requests[sid] = _Request(seq, cb, make_generator(params))
        self._by_id[request_id] = sid

    def _finish(self, sid: int, reason: FinishReason, error: str | None = None) -> None:
        req = self._requests.pop(sid)
        self._by_id.pop(req.seq.request_id, None)
        with self._lock:
            self._unfinished -= 1
        req.on_event(TokenEvent(req.seq.request_id, [], reason, req.seq.num_prompt_tokens,
                                error=error))

    def step(self) -> StepPlan | None:
        """Run one iteration if there is work; returns the plan it ran."""
        self._drain_inbox()
        if not self.scheduler.has_unfinished():
            # A cancel or a rejection may just have emptied the batch: /metrics must see it.
            self._refresh_stats()
            return None
        plan = self.scheduler.schedule()
        if self.comm is not None:
            self.comm.send_plan(plan)
        sampled_ids, logits = self.runner.execute(plan)
        sampled: dict[int, int] = {}
        if sampled_ids:
            rows = [(self._requests[s].seq.params, self._requests[s].generator) for s in sampled_ids]
            sampled = dict(zip(sampled_ids, self.sampler(logits, rows)))  # type: ignore[arg-type]
        for seq in self.scheduler.update(plan, sampled):
            req = self._requests[seq.seq_id]
            new = seq.output_token_ids[req.emitted :]
            req.emitted = len(seq.output_token_ids)
            if seq.finish_reason is not None:
                self._requests.pop(seq.seq_id)
                self._by_id.pop(seq.request_id, None)
                with self._lock:
                    self._unfinished -= 1
            req.on_event(TokenEvent(seq.request_id, new, seq.finish_reason, seq.num_prompt_tokens))
        self._refresh_stats()
        return plan

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
                   "prefix_cache_queries_total": float(s.prefix_cache_queries_total)},
        )

    def abort_all(self, reason: FinishReason = "cancelled", error: str | None = None) -> None:
        self._drain_inbox()
        for sid in list(self._requests):
            if self.scheduler.abort(sid, reason):
                self._finish(sid, reason, error)

    def fail_all(self, why: str) -> None:
        """The engine cannot go on: end every request, queued or running, with an error.
        Called on the engine thread after a failed step; the scheduler's state is not
        trusted any more, so requests are ended directly."""
        self._drain_inbox()
        for sid in list(self._requests):
            self._finish(sid, "error", why)

    def shutdown_workers(self) -> None:
        if self.comm is not None:
            self.comm.send_plan(StepPlan(step_id=-1, shutdown=True))

    # ---- a synchronous helper (tests, benchmarks) ------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        """Submit all prompts at once and step until every one finishes."""
        out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        done: dict[str, str] = {}

        def cb(ev: TokenEvent) -> None:
            out[ev.request_id].extend(ev.token_ids)
            if ev.finish_reason is not None:
                done[ev.request_id] = ev.error or ev.finish_reason

        for i, (p, sp) in enumerate(zip(prompts, params)):
            self.add_request(str(i), p, sp, cb)
        while len(done) < len(prompts):
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
