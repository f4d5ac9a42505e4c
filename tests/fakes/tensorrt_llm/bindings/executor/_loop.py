"""The leader's execution thread: in-flight batching over a paged KV cache, one token per
request per iteration, responses queued for await_responses (reference §2.1).

Admission reserves a request's whole KV footprint (prompt + max_tokens) up front, which is
GUARANTEED_NO_EVICT; the fake uses it for MAX_UTILIZATION too (it never pauses requests).
STATIC_BATCH admits only into an empty batch.

As executorImpl.cpp's executionLoop does:
- cancellation and allotted time apply to active requests only: a request cancelled while
  queued is admitted (and runs one step) before it ends CANCELLED; its generated tokens are
  cleared (`clearGeneratedTokens`);
- shutdown on the leader queues a terminate request behind every queued request and keeps
  stepping until the queue and the active batch are empty (`while (!mShutdown ||
  !activeRequests.empty())`), so it blocks until running requests finish;
- sampling (top_k > 1, or top_p > 0 without top_k) draws from a generator seeded with the
  request's SamplingConfig.seed, and with 0 when no seed is given: identical requests without
  a seed sample identical tokens (NVIDIA/TensorRT-LLM #1000, #2411).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..._fake import env
from ..._fake.toy import Penalties, ends_with_stop_word
from ._config import ExecutorConfig
from ._enums import CapacitySchedulerPolicy, FinishReason
from ._guided import FORWARD_ERROR, GuidedDecoder
from ._load import LoadedEngine
from ._request import Request, Response, Result, SamplingConfig
from ._stats import (
    InflightBatchingStats,
    IterationStats,
    KvCacheStats,
    RequestStats,
    RequestStatsPerIteration,
)


@dataclass
class Seq:
    id: int
    req: Request
    max_tokens: int  # after clamping to max_seq_len
    blocks: int  # reserved KV blocks
    enqueued_at: float
    generated: list[int] = field(default_factory=list)
    iters: int = 0
    rng: random.Random | None = None  # sampling requests only
    matcher: Any = None  # xgrammar's GrammarMatcher, guided requests only

    def __post_init__(self) -> None:
        sc = self.req.sampling_config
        if sampled(sc):
            self.rng = random.Random(0 if sc.seed is None else sc.seed)


def sampled(sc: SamplingConfig) -> bool:
    """Random sampling: top_k > 1, or top_p > 0 with top_k unset/0; otherwise greedy."""
    if sc.top_k is not None and sc.top_k > 1:
        return True
    return (sc.top_k is None or sc.top_k == 0) and sc.top_p is not None and sc.top_p > 0


class Loop:
    def __init__(
        self,
        eng: LoadedEngine,
        cfg: ExecutorConfig,
        max_batch_size: int,
        max_num_tokens: int,
        max_blocks: int,
        max_seq_len: int,
        max_input_len: int,
        guided: GuidedDecoder | None = None,
    ) -> None:
        self.eng, self.cfg, self.guided = eng, cfg, guided
        self.max_batch_size, self.max_num_tokens, self.max_blocks = (
            max_batch_size,
            max_num_tokens,
            max_blocks,
        )
        # The engine's, or less when the KV cache cannot hold one max_seq_len sequence.
        self.max_seq_len, self.max_input_len = max_seq_len, max_input_len
        self.tpb: int = eng.build["plugin_config"]["tokens_per_block"]
        self.cond = threading.Condition()
        self.queued: list[Seq] = []
        self.active: list[Seq] = []
        self.ready: deque[Response] = deque()
        self.delivered_final: set[int] = set()
        self.iter_stats: deque[IterationStats] = deque(maxlen=cfg.iter_stats_max_iterations)
        self.req_stats: deque[RequestStatsPerIteration] = deque(
            maxlen=cfg.request_stats_max_iterations
        )
        self.hold = 0
        self.cancelled: set[int] = set()  # ids cancelled, applied once they are active
        self.terminating = False  # shutdown() queued its terminate request
        self.stopped = False
        self._iter = 0
        self._alloc_total = 0
        self._reused = self._missed = 0
        self._seen_blocks: set[int] = set()
        self._finished: set[int] = set()  # ids finished in the current iteration
        self._thread = threading.Thread(target=self._run, name="fake-trtllm-executor", daemon=True)
        self._thread.start()

    def terminate(self) -> None:
        """The leader's shutdown(): queue the terminate request and wait until every queued
        and active request has finished, then the thread ends."""
        with self.cond:
            self.terminating = True
            self.cond.notify_all()
        self._thread.join()

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.tpb)

    def _run(self) -> None:
        while True:
            with self.cond:
                while self.hold or not (self.queued or self.active or self.terminating):
                    self.cond.wait()
                if self.terminating and not (self.queued or self.active):
                    self.stopped = True
                    self.cond.notify_all()
                    return
                self._iteration()
                self.cond.notify_all()
            time.sleep(env.iter_delay_s())

    def _used(self, seqs: list[Seq]) -> int:
        return sum(self.blocks_for(len(s.req.input_token_ids) + len(s.generated)) for s in seqs)

    def _iteration(self) -> None:
        t0 = time.monotonic()
        self._finished.clear()
        # Cancelled and timed-out requests end only once active (terminateCancelledRequests,
        # finishTimedOutRequests run over the active batch).
        for seq in self.active:
            reason = self._early_finish(seq, t0)
            if reason is not None:
                seq.generated.clear()
                self._finish(seq, reason, [])
        self.active = [s for s in self.active if s.id not in self._finished]
        used_before = self._used(self.active)
        admitted = self._admit()
        if not self._start_guides(admitted):
            self._record(t0, admitted, [], 0, 0)
            return
        stepped = self.active
        for seq in stepped:
            seq.iters += 1
            self._step(seq)
        new_blocks = max(0, self._used(stepped) - used_before)
        self._alloc_total += new_blocks
        self.active = [s for s in stepped if s.id not in self._finished]  # frees their blocks
        n_ctx = sum(len(s.req.input_token_ids) for s in admitted)
        self._record(t0, admitted, stepped, n_ctx, new_blocks)

    def _start_guides(self, admitted: list[Seq]) -> bool:
        """Compile each admitted request's guide (guidedDecoder.cpp, first context step).
        A guide that does not compile throws inside forwardAsync, and executorImpl.cpp's
        terminateActiveRequests ends EVERY active request with that error."""
        for seq in admitted:
            params = seq.req.guided_decoding_params
            if params is None or self.guided is None:
                continue
            try:
                seq.matcher = self.guided.matcher(params)
            except Exception as e:  # xgrammar's words, as the C++ exception carries them
                err = FORWARD_ERROR + " ".join(str(e).split())
                env.log("ERROR", err)
                for s in self.active:
                    self._finished.add(s.id)
                    self.ready.append(Response(s.id, error_msg=err, client_id=s.req.client_id))
                self.active = []
                return False
        return True

    def _early_finish(self, seq: Seq, now: float) -> FinishReason | None:
        if seq.id in self.cancelled:
            self.cancelled.discard(seq.id)
            return FinishReason.CANCELLED
        limit = seq.req.allotted_time_ms
        if limit is not None and (now - seq.enqueued_at) * 1000 > limit:
            return FinishReason.TIMED_OUT
        return None

    def _admit(self) -> list[Seq]:
        policy = self.cfg.scheduler_config.capacity_scheduler_policy
        if policy is CapacitySchedulerPolicy.STATIC_BATCH and self.active:
            return []
        reserved = sum(s.blocks for s in self.active)
        budget = self.max_num_tokens
        admitted: list[Seq] = []
        for seq in sorted(self.queued, key=lambda s: (-s.req.priority, s.id)):
            ctx = len(seq.req.input_token_ids)
            full = len(self.active) + len(admitted) >= self.max_batch_size
            if full or reserved + seq.blocks > self.max_blocks or (admitted and ctx > budget):
                break
            reserved += seq.blocks
            budget -= ctx
            admitted.append(seq)
            self._count_reuse(seq.req.input_token_ids)
        for seq in admitted:
            self.queued.remove(seq)
        self.active += admitted
        return admitted

    def _count_reuse(self, prompt: list[int]) -> None:
        if not self.cfg.kv_cache_config.enable_block_reuse:
            return
        h = 0
        for i in range(len(prompt) // self.tpb):  # full blocks only, hash chained
            h = hash((h, tuple(prompt[i * self.tpb : (i + 1) * self.tpb])))
            if h in self._seen_blocks:
                self._reused += 1
            else:
                self._missed += 1
                self._seen_blocks.add(h)

    def _step(self, seq: Seq) -> None:
        r = seq.req
        seq_tokens = r.input_token_ids + seq.generated
        min_tokens = r.sampling_config.min_tokens or 0
        offset = 0
        if seq.rng is not None:  # sampling: one of the top_k candidates (all, without top_k)
            k = r.sampling_config.top_k
            offset = seq.rng.randrange(k if k is not None and k > 1 else self.eng.toy.vocab_size)
        sc = r.sampling_config
        pen = Penalties(sc.temperature, sc.repetition_penalty, sc.presence_penalty,
                        sc.frequency_penalty)
        allowed = None
        if seq.matcher is not None:
            allowed = GuidedDecoder.allowed(seq.matcher, self.eng.toy.vocab_size)
        tok = self.eng.toy.choose(
            seq_tokens, len(seq.generated), r.end_id, r.bad_words or [], min_tokens, offset, pen,
            allowed,
        )
        if seq.matcher is not None and not seq.matcher.is_terminated():
            seq.matcher.accept_token(tok)
        if r.end_id is not None and tok == r.end_id:
            self._finish(seq, FinishReason.END_ID, [])  # end_id is not an output token
            return
        seq.generated.append(tok)
        if ends_with_stop_word([*seq_tokens, tok], r.stop_words or []):
            self._finish(seq, FinishReason.STOP_WORDS, [tok])
        elif len(seq.generated) >= seq.max_tokens:
            self._finish(seq, FinishReason.LENGTH, [tok])
        elif r.streaming:
            self._emit(seq, [tok], FinishReason.NOT_FINISHED)

    def _finish(self, seq: Seq, reason: FinishReason, new: list[int]) -> None:
        self._finished.add(seq.id)
        self._emit(seq, new, reason)

    def _emit(self, seq: Seq, new: list[int], reason: FinishReason) -> None:
        r = seq.req
        final = reason is not FinishReason.NOT_FINISHED
        if r.streaming:  # streaming never includes the prompt
            tokens = list(seq.generated) if r.return_all_generated_tokens else new
        elif r.output_config.exclude_input_from_output:
            tokens = list(seq.generated)
        else:
            tokens = r.input_token_ids + seq.generated
        logp = r.output_config.return_log_probs
        result = Result(
            is_final=final,
            output_token_ids=[tokens],
            finish_reasons=[reason],
            decoding_iter=seq.iters,
            is_sequence_final=final,
            log_probs=[[0.0] * len(tokens)] if logp else None,  # the toy is certain
            cum_log_probs=[0.0] if logp else None,
        )
        self.ready.append(Response(seq.id, result=result, client_id=r.client_id))

    def _record(
        self, t0: float, admitted: list[Seq], stepped: list[Seq], n_ctx: int, new_blocks: int
    ) -> None:
        used = self._used(self.active)
        if self.cfg.request_stats_max_iterations > 0:
            self.req_stats.append(
                RequestStatsPerIteration(
                    self._iter, [RequestStats(s.id, len(s.generated)) for s in stepped]
                )
            )
        waits = [(t0 - s.enqueued_at) * 1000 for s in admitted]
        kv = KvCacheStats(
            max_num_blocks=self.max_blocks,
            free_num_blocks=self.max_blocks - used,
            used_num_blocks=used,
            tokens_per_block=self.tpb,
            alloc_total_blocks=self._alloc_total,
            alloc_new_blocks=new_blocks,
            reused_blocks=self._reused,
            missed_blocks=self._missed,
            cache_hit_rate=self._reused / max(1, self._reused + self._missed),
        )
        ifb = InflightBatchingStats(
            num_scheduled_requests=len(stepped),
            num_context_requests=len(admitted),
            num_gen_requests=len(stepped) - len(admitted),
            num_ctx_tokens=n_ctx,
            avg_num_decoded_tokens_per_iter=1.0 if stepped else 0.0,
        )
        kv_bytes = self.max_blocks * self.tpb * self.eng.kv_bytes_per_token
        if self.cfg.iter_stats_max_iterations > 0:
            self.iter_stats.append(
                IterationStats(
                    timestamp=datetime.now().strftime("%m-%d-%Y %H:%M:%S"),
                    iter=self._iter,
                    iter_latency_ms=(time.monotonic() - t0) * 1000,
                    new_active_requests_queue_latency_ms=sum(waits) / len(waits) if waits else 0.0,
                    num_new_active_requests=len(admitted),
                    num_active_requests=len(stepped),
                    num_queued_requests=len(self.queued),
                    num_completed_requests=len(self._finished),
                    max_num_active_requests=self.max_batch_size,
                    gpu_mem_usage=self.eng.weight_bytes + kv_bytes,
                    kv_cache_stats=kv,
                    inflight_batching_stats=ifb,
                )
            )
        self._iter += 1
