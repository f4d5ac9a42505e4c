"""`runtime.core.types.Executor` over TensorRT-LLM's C++ Executor (`tensorrt_llm.bindings.executor`).

Written against shared/reference/tensorrt-llm-1.2-api.md §2.1-§2.2. LEADER mode: every rank
constructs the Executor with the same arguments (collective; `construct_executor`); only
rank 0 (the leader) enqueues, awaits, cancels and reads statistics (`TrtllmExecutor`); the
other ranks call `shutdown()`, which blocks until the leader shuts down.

The leader's `shutdown()` blocks too, until every queued and active request has finished
(executorImpl.cpp keeps stepping after its terminate request), and a cancel reaches a queued
request only once it has been admitted: `TrtllmExecutor.shutdown` therefore cancels what is
left and waits for it before shutting the Executor down, bounded, and then drops its
reference, so that the Executor (whose destructor frees MPI communicators) is destroyed
before anyone finalizes MPI.

Threads: the HTTP thread calls `add_request` / `cancel` (both return at once); one
background thread blocks in `await_responses(timeout=...)` and turns responses into
TokenEvents, and reads the iteration statistics (which drain on read) into a snapshot that
`stats()` returns without touching the Executor.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from runtime.core.types import (
    EventCallback,
    ExecutorStats,
    FinishReason,
    SamplingParams,
    TokenEvent,
    UnsupportedParameter,
)
from runtime.executors.trtllm_request import (
    NO_GUIDED_CONFIG,
    chosen_logprobs,
    continuation,
    make_request,
    min_tokens_phases,
)
from runtime.executors.trtllm_setup import bindings

log = logging.getLogger("serve.trtllm")
POLL_S = 0.05  # await_responses timeout: how fast shutdown and statistics are noticed
CANCEL_WAIT_S = 5.0  # shutdown: how long cancelled requests may take to end
SHUTDOWN_WAIT_S = 30.0  # shutdown: how long Executor.shutdown() may block
# TensorRT-LLM's finish reasons (reference §2.1) -> ours; TIMED_OUT and unknown ones are errors.
_FINISH: dict[str, FinishReason] = {
    "END_ID": "stop", "STOP_WORDS": "stop", "LENGTH": "length", "CANCELLED": "cancelled",
}


@dataclass(slots=True)
class _Live:
    request_id: str
    on_event: EventCallback
    num_prompt_tokens: int
    trt_id: int = -1
    emitted: int = 0
    cancelled: bool = False
    # min_tokens with stop ids besides end_id: the params to continue with once the first
    # phase (the first min_tokens tokens) ends, its prompt, and the tokens it produced.
    rest: SamplingParams | None = None
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)


class TrtllmExecutor:
    """Implements `runtime.core.types.Executor` on the leader rank over a constructed Executor."""

    # tool_choice auto's grammar (serve/api/tool_grammars.py) is a structural tag, printed
    # as EBNF with xgrammar 0.2's TagDispatch; TensorRT-LLM links its own xgrammar (0.1.x
    # pinned), which may not parse it, and there a guide that fails to compile ends the
    # whole active batch. So auto's calls are parsed from free text on trtllm
    # (serve/api/tools.py's prepare); required / named / generic grammars are plain EBNF.
    guided_decoding = False

    def __init__(self, ex: Any, *, eos_token_ids: tuple[int, ...] = (), pad_id: int = 0,
                 poll_s: float = POLL_S, guided_unavailable: str | None = NO_GUIDED_CONFIG
                 ) -> None:
        self._ex = ex
        # None when the Executor has a GuidedDecodingConfig; else why structured output is off.
        self.guided_unavailable = guided_unavailable
        self._tx = bindings()
        self.eos_token_ids = eos_token_ids
        self.pad_id = pad_id
        self._poll = timedelta(seconds=poll_s)
        self._lock = threading.Lock()
        self._live: dict[int, _Live] = {}  # TensorRT-LLM request id -> request
        self._by_request: dict[str, int] = {}  # our request id -> TensorRT-LLM request id
        self._stats = ExecutorStats()
        self._steps = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._closed = False
        self.error: str | None = None  # set when the Executor failed; nothing is served after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._await_loop, name="trtllm-await", daemon=True)
        self._thread.start()

    # ---- Executor interface (thread-safe, never blocks on model work) ------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    on_event: EventCallback) -> None:
        live = _Live(request_id, on_event, len(prompt_token_ids))
        phases = min_tokens_phases(params, self.eos_token_ids)
        if phases is None:
            request = self.make_request(prompt_token_ids, params)
        else:
            if params.guided is not None:
                # The second phase is a new Request, whose grammar would start over.
                raise UnsupportedParameter("min_tokens", "min_tokens together with "
                                           "structured output is not supported by the trtllm "
                                           "backend (min_tokens runs as two requests here, "
                                           "and the grammar would restart in the second)")
            first, bad_words = phases
            request = make_request(self._tx, prompt_token_ids, first, self.eos_token_ids,
                                   self.pad_id, bad_words, self.guided_unavailable)
            if params.max_tokens > first.max_tokens:
                live.rest, live.prompt = params, list(prompt_token_ids)
        # Enqueue under the lock: a response can only be dispatched once its id is known.
        with self._lock:
            if self._closed or self.error is not None:
                raise ValueError(self.error or "the executor is shutting down")
            try:
                live.trt_id = self._ex.enqueue_request(request)
            except Exception as e:  # queue full, invalid request: TensorRT-LLM's words
                raise ValueError(f"TensorRT-LLM refused the request: {e}") from None
            self._live[live.trt_id] = live
            self._by_request[request_id] = live.trt_id

    def cancel(self, request_id: str) -> None:
        with self._lock:
            trt_id = self._by_request.get(request_id)
            ex = self._ex
            live = self._live.get(trt_id) if trt_id is not None else None
            if live is not None:
                live.cancelled = True  # a second phase is not started after this
        if trt_id is None or ex is None:
            return  # finished, or the Executor is shut down (shutdown ended it)
        # The final response (finish reason CANCELLED) ends the request in _dispatch; a
        # queued request is cancelled once TensorRT-LLM has admitted it.
        try:
            ex.cancel_request(trt_id)
        except Exception as e:  # "Shutdown called": shutdown() is ending it
            log.info("request %s: cancel_request(%d) not sent (%s)", request_id, trt_id, e)
            return
        log.info("request %s: cancel_request(%d) sent", request_id, trt_id)

    def stats(self) -> ExecutorStats:
        return self._stats

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._live)

    # ---- requests ---------------------------------------------------------------------

    def make_request(self, prompt: list[int], params: SamplingParams) -> Any:
        return make_request(self._tx, prompt, params, self.eos_token_ids, self.pad_id,
                            guided_unavailable=self.guided_unavailable)

    # ---- the await thread ----------------------------------------------------------------

    def _await_loop(self) -> None:
        while not self._stop.is_set():
            try:
                responses = self._ex.await_responses(timeout=self._poll)
                for resp in responses:
                    self._dispatch(resp)
                self._read_stats()
            except Exception as e:  # the Executor itself failed: fail everything, loudly
                if self._stop.is_set():
                    return
                log.exception("the TensorRT-LLM Executor failed")
                self._fail_all(f"the TensorRT-LLM Executor failed: {type(e).__name__}: {e}")
                return

    def _dispatch(self, resp: Any) -> None:
        with self._lock:
            live = self._live.get(resp.request_id)
        if live is None:
            log.debug("response for unknown request id %s", resp.request_id)
            return
        if resp.has_error():
            self._end(live, TokenEvent(live.request_id, [], "error", live.num_prompt_tokens,
                                       error=str(resp.error_msg)))
            return
        result = resp.result
        beams = result.output_token_ids
        tokens = [int(t) for t in beams[0]] if beams else []
        if live.emitted == 0 and (tokens or result.is_final):
            with self._lock:
                self._prompt_tokens += live.num_prompt_tokens
        live.emitted += len(tokens)
        if live.rest is not None:  # a first phase: its tokens start the second one's prompt
            live.output += tokens
        with self._lock:
            self._generation_tokens += len(tokens)
        logprobs = chosen_logprobs(result, tokens)
        if not result.is_final:
            if tokens:
                live.on_event(TokenEvent(live.request_id, tokens, None, live.num_prompt_tokens,
                                         logprobs=logprobs))
            return
        reasons = result.finish_reasons
        name = getattr(reasons[0], "name", str(reasons[0])) if reasons else "NOT_FINISHED"
        if (live.rest is not None and name == "LENGTH"
                and len(live.output) == live.rest.min_tokens):  # the first phase is done
            if tokens:
                live.on_event(TokenEvent(live.request_id, tokens, None,
                                         live.num_prompt_tokens, logprobs=logprobs))
            self._continue(live)
            return
        finish = _FINISH.get(name, "error")
        error = None if finish != "error" else f"generation ended with {name}"
        if finish == "cancelled":
            log.info("request %s (id %d) finished CANCELLED after %d tokens",
                     live.request_id, live.trt_id, live.emitted)
        self._end(live, TokenEvent(live.request_id, tokens, finish, live.num_prompt_tokens,
                                   error=error, logprobs=logprobs))

    def _continue(self, live: _Live) -> None:
        """The second phase of a min_tokens request: prompt + the first phase's tokens."""
        assert live.rest is not None
        params, live.rest = continuation(live.rest, len(live.output)), None
        request = self.make_request(live.prompt + live.output, params)
        why: str | None = None
        with self._lock:
            if self._closed or live.cancelled:
                why = "cancelled"
            else:
                try:
                    trt_id = self._ex.enqueue_request(request)
                except Exception as e:
                    why = f"TensorRT-LLM refused the request's continuation: {e}"
                else:
                    self._live.pop(live.trt_id, None)
                    live.trt_id = trt_id
                    self._live[trt_id] = live
                    self._by_request[live.request_id] = trt_id
        if why == "cancelled":
            self._end(live, TokenEvent(live.request_id, [], "cancelled", live.num_prompt_tokens))
        elif why is not None:
            self._end(live, TokenEvent(live.request_id, [], "error", live.num_prompt_tokens,
                                       error=why))

    def _end(self, live: _Live, event: TokenEvent) -> None:
        with self._lock:
            self._live.pop(live.trt_id, None)
            self._by_request.pop(live.request_id, None)
        live.on_event(event)

    def _fail_all(self, why: str, finish: FinishReason = "error") -> None:
        with self._lock:
            if finish == "error":
                self.error = why
            lives = list(self._live.values())
        for live in lives:
            self._end(live, TokenEvent(live.request_id, [], finish, live.num_prompt_tokens,
                                       error=why if finish == "error" else None))

    def _read_stats(self) -> None:
        """The newest IterationStats (the buffer drains on read) -> an ExecutorStats snapshot."""
        its = self._ex.get_latest_iteration_stats()
        if not its:
            with self._lock:
                n = len(self._live)
            if n == 0 and self._stats.running:  # idle: no iteration reports the drop to 0
                self._stats = ExecutorStats(
                    kv_blocks_total=self._stats.kv_blocks_total, steps_total=self._steps,
                    prompt_tokens_total=self._prompt_tokens,
                    generation_tokens_total=self._generation_tokens, extra=self._stats.extra)
            return
        self._steps += len(its)
        it = its[-1]
        kv = it.kv_cache_stats
        ifb = it.inflight_batching_stats
        extra = {"iter_latency_ms": float(it.iter_latency_ms),
                 "gpu_mem_usage_bytes": float(it.gpu_mem_usage)}
        total = used = 0
        if kv is not None:
            total, used = int(kv.max_num_blocks), int(kv.used_num_blocks)
            extra.update(kv_free_blocks=float(kv.free_num_blocks),
                         kv_tokens_per_block=float(kv.tokens_per_block),
                         kv_reused_blocks=float(kv.reused_blocks),
                         kv_cache_hit_rate=float(kv.cache_hit_rate))
        tokens = 0
        if ifb is not None:
            tokens = int(ifb.num_ctx_tokens) + int(ifb.num_gen_requests)
            extra.update(context_requests=float(ifb.num_context_requests),
                         generation_requests=float(ifb.num_gen_requests))
        with self._lock:
            prompt, generated = self._prompt_tokens, self._generation_tokens
            live = len(self._live)
        # An iteration counts the requests that finished in it as active; ours are gone.
        self._stats = ExecutorStats(
            running=min(int(it.num_active_requests), live), waiting=int(it.num_queued_requests),
            kv_blocks_total=total, kv_blocks_used=used, steps_total=self._steps,
            tokens_last_step=tokens, prompt_tokens_total=prompt,
            generation_tokens_total=generated, extra=extra,
        )

    # ---- lifecycle ---------------------------------------------------------------------

    def cancel_all(self, wait_s: float = 2.0) -> int:
        """Cancel every unfinished request and wait (bounded) for their final responses."""
        with self._lock:
            ids = list(self._by_request)
        for rid in ids:
            try:
                self.cancel(rid)
            except Exception:
                log.exception("cancel_request for %s failed", rid)
        deadline = time.monotonic() + wait_s
        while self.num_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(ids)

    def shutdown(self, cancel_wait_s: float = CANCEL_WAIT_S,
                 shutdown_wait_s: float = SHUTDOWN_WAIT_S) -> bool:
        """End every request, shut the Executor down (which releases the other ranks) and drop
        it. True when Executor.shutdown() returned; False when it was still blocked after
        `shutdown_wait_s` (the Executor is then left to the process's exit).

        The leader's Executor.shutdown() blocks until every queued and active request has
        finished, and awaiting fails once it is called: so the requests still running are
        cancelled first, and their final responses awaited while this thread still reads
        them (a queued one ends only after admission)."""
        with self._lock:
            self._closed = True
            ex = self._ex
        if ex is None:
            return True
        if self.num_unfinished() and self.error is None:
            self.cancel_all(cancel_wait_s)
        self._stop.set()
        self._thread.join(timeout=max(5.0, 4 * self._poll.total_seconds()))
        done = threading.Event()

        def _shutdown() -> None:
            try:
                ex.shutdown()
            except Exception:
                log.exception("Executor.shutdown() failed")
            finally:
                done.set()

        threading.Thread(target=_shutdown, name="trtllm-shutdown", daemon=True).start()
        ok = done.wait(shutdown_wait_s)
        if not ok:
            log.error("Executor.shutdown() still blocked after %.0f s (requests TensorRT-LLM "
                      "did not end)", shutdown_wait_s)
        # Whatever did not get its final response ends here, so no caller waits forever.
        self._fail_all("the executor shut down before the request finished",
                       finish="cancelled")
        if ok:
            with self._lock:
                self._ex = None  # the caller may now let the Executor be destroyed
        return ok

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 timeout_s: float = 600.0) -> list[tuple[list[int], str]]:
        """Submit all prompts at once and wait: [(tokens, finish reason)] (warmup, golden)."""
        tag = next(_GENERATE_IDS)
        rids = [f"generate-{tag}-{i}" for i in range(len(prompts))]
        out: dict[str, list[int]] = {rid: [] for rid in rids}
        finish: dict[str, str] = {}
        done = threading.Event()
        lock = threading.Lock()

        def on_event(ev: TokenEvent) -> None:
            with lock:
                out[ev.request_id].extend(ev.token_ids)
                if ev.finish_reason is not None:
                    finish[ev.request_id] = ev.error or ev.finish_reason
                    if len(finish) == len(rids):
                        done.set()

        for rid, prompt, sp in zip(rids, prompts, params, strict=True):
            self.add_request(rid, prompt, sp, on_event)
        if not done.wait(timeout_s):
            raise TimeoutError(f"{len(rids) - len(finish)} request(s) unfinished after "
                               f"{timeout_s:.0f} s")
        bad = [v for v in finish.values() if v not in ("stop", "length")]
        if bad:
            raise RuntimeError(bad[0])
        return [(out[rid], finish[rid]) for rid in rids]


_GENERATE_IDS = itertools.count()
