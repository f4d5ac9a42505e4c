"""One HTTP generation request in flight: its executor requests, choices, usage, metrics.

A completion batch of P prompts with n choices each is P executor requests (`_Sub`), each
generating n (or best_of) sequences; choice i of prompt p is index p * n + i, as in
OpenAI's and vLLM's answers. Token events arrive on the engine thread and cross into the
event loop through `loop.call_soon_threadsafe` into one asyncio.Queue, each with the time
the engine produced it. A request without streaming and without stop strings has nothing
to do with its tokens before the last: they are held on the engine thread and cross in
one call at the end, instead of waking the event loop (and taking the GIL) every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.core.types import SamplingParams, TokenEvent, TokenLogprob
from serve.api.choices import ChatLogprobs, Choice, CompletionLogprobs, TokenTexts
from serve.api.detok import OutputText
from serve.api.protocol import ApiError, GenerationRequest
from serve.api.reasoning import (
    ReasoningSplitter,
    reasoning_delta,
    reasoning_message,
    reasoning_opened,
)
from serve.api.state import ServerState
from serve.api.tools import ToolStream, parse_output


@dataclass(eq=False)
class _Sub:
    """One executor request: one prompt and its sequences."""

    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    choices: list[Choice]
    live: int  # sequences the executor has not finished
    cancelled: bool = False  # we cancelled it (its choices all ended): ignore what follows
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    echoed: set[int] = field(default_factory=set)

    @property
    def engine_done(self) -> bool:
        return self.live == 0


@dataclass(slots=True)
class Update:
    """What one event changed for one choice."""

    choice: Choice
    text: str
    finish: str | None


class Run:
    def __init__(self, state: ServerState, req: GenerationRequest, prompts: list[list[int]],
                 params: SamplingParams, arrival: float, texts: TokenTexts) -> None:
        self.loop = asyncio.get_running_loop()
        self.state, self.req, self.params, self.arrival = state, req, params, arrival
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue: asyncio.Queue[tuple[int, TokenEvent, float]] = asyncio.Queue()
        self._last_token_at: float | None = None
        self._tool_streams: dict[int, ToolStream] = {}  # choice index -> its tool calls
        eos = () if req.ignore_eos else state.eos_token_ids()
        single = len(prompts) == 1
        self.subs: list[_Sub] = []
        for p, ids in enumerate(prompts):
            choices = []
            for i in range(params.num_sequences):
                lps: CompletionLogprobs | ChatLogprobs | None = None
                if req.logprobs is not None:
                    lps = ChatLogprobs(texts) if req.kind == "chat" else CompletionLogprobs(texts)
                output = OutputText(state.tokenizer, ids, req.stop, skip_token_ids=eos)
                choices.append(Choice(p * req.n + i, output, lps, discard=req.max_tokens == 0))
            text = ""
            if req.echo:
                given = req.prompts[p]
                text = given if isinstance(given, str) else state.tokenizer.decode(
                    ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if req.kind == "chat" and state.reasoning is not None:
                opened = reasoning_opened(state.reasoning, state.tokenizer, ids)
                for c in choices:
                    c.reasoning = ReasoningSplitter(state.reasoning, opened)
            rid = self.request_id if single else f"{self.request_id}-{p}"
            self.subs.append(_Sub(rid, ids, text, choices, live=0))  # live once submitted

    @property
    def engine_done(self) -> bool:
        return all(sub.engine_done for sub in self.subs)

    @property
    def choices(self) -> list[Choice]:
        return [c for sub in self.subs for c in sub.choices]

    def callback(self, sub: int) -> Callable[[TokenEvent], None]:
        hold = not self.req.stream and not self.req.stop
        held: list[tuple[int, TokenEvent, float]] = []  # the engine thread's alone

        def on_event(event: TokenEvent) -> None:
            """Called on the engine thread: hand the event to the event loop, never block."""
            item = (sub, event, time.perf_counter())
            if hold and event.finish_reason is None:
                held.append(item)
                return
            items = [*held, item]
            held.clear()
            # RuntimeError: the loop is closed (server stopped); nobody waits for the event.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._put_all, items)
        return on_event

    def _put_all(self, items: list[tuple[int, TokenEvent, float]]) -> None:
        for item in items:
            self.queue.put_nowait(item)

    def _observe(self, n_tokens: int, first_sequence: bool, now: float) -> None:
        metrics = self.state.metrics
        if self._last_token_at is None:
            metrics.ttft.observe(now - self.arrival)
            # The prompts have been processed.
            metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in self.subs))
            self._last_token_at = now
        elif first_sequence:
            # One sequence's gaps (siblings arrive in the same step); tokens that arrive
            # together share the gap (one histogram sample per token).
            gap = (now - self._last_token_at) / n_tokens
            for _ in range(n_tokens):
                metrics.itl.observe(gap)
            self._last_token_at = now
        metrics.generation_tokens.inc(n_tokens)

    async def next(self) -> tuple[_Sub, Update | None]:
        """Wait for the next engine event; the update of the choice it concerns (None when
        it concerns nothing the client sees). Raises ApiError when the request failed."""
        p, event, at = await self.queue.get()
        sub = self.subs[p]
        if sub.cancelled:
            return sub, None  # the cancelled request's last events (a batch's other prompts
            # are still running)
        if event.finish_reason in ("cancelled", "rejected", "error"):
            sub.live = 0
            reason = event.error or "unknown error"
            if event.finish_reason == "cancelled":
                raise ApiError(503, "the request was cancelled by the server", code="cancelled")
            if event.finish_reason == "rejected":
                # The engine refuses at admission what it can never serve (e.g. more KV
                # blocks than the cache has): the client can fix that, so it is a 400.
                raise ApiError(400, f"the engine rejected the request: {reason}",
                               code="engine_rejected")
            raise ApiError(500, f"generation failed: {reason}", code="generation_error")
        if event.finish_reason is not None:
            sub.live -= 1
        sub.cached_tokens = max(sub.cached_tokens, event.num_cached_tokens)
        if event.prompt_logprobs is not None:
            sub.prompt_logprobs = event.prompt_logprobs
        choice = sub.choices[event.index]
        if choice.finish is not None:
            return sub, None  # ended by a stop string; its sequence runs out unseen
        if event.token_ids and not choice.discard:
            self._observe(len(event.token_ids), sub is self.subs[0] and event.index == 0, at)
        text = ""
        if self.req.echo and event.index not in sub.echoed:
            sub.echoed.add(event.index)
            text = choice.echo(sub.prompt_text, sub.prompt_ids, sub.prompt_logprobs)
        text += choice.push(event.token_ids, event.logprobs, event.finish_reason)
        if event.finish_reason is not None:
            choice.cumulative_logprob = event.cumulative_logprob
        if choice.finish is not None:
            self._finished(choice)
        return sub, Update(choice, text, choice.finish)

    def _finished(self, choice: Choice) -> None:
        if self.done:  # the request's last choice: one sample per request
            metrics = self.state.metrics
            metrics.e2e.observe(time.perf_counter() - self.arrival)
            metrics.request_success.labels(finished_reason=choice.finish).inc()

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    def best(self) -> list[Choice]:
        """The choices to return: all, or per prompt the n best by cumulative
        log-probability when best_of > n (renumbered p * n + rank)."""
        if self.params.num_sequences == self.req.n:
            return self.choices
        out: list[Choice] = []
        for p, sub in enumerate(self.subs):
            ranked = sorted(sub.choices, key=lambda c: -(c.cumulative_logprob or 0.0))
            for rank, c in enumerate(ranked[:self.req.n]):
                c.index = p * self.req.n + rank
                out.append(c)
        return out

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(s.prompt_ids) for s in self.subs)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                # How many prompt tokens the prefix cache served (TensorRT-LLM's and
                # vLLM's field; AIPerf reads it to show prefix-cache hits).
                "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens
                                                               for s in self.subs)}}

    def envelope(self, chunk: bool) -> dict[str, Any]:
        chat = self.req.kind == "chat"
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat \
            else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.state.model_name}

    def _logprobs(self, choice: Choice) -> dict[str, Any] | None:
        return choice.logprobs.take() if choice.logprobs is not None else None

    def stream_choice(self, choice: Choice, text: str | None, finish: str | None,
                      first: bool = False) -> dict[str, Any]:
        """A streamed choice (text None: no content in this chunk); the first chunk of a
        chat choice announces the role and carries nothing else."""
        lps = None if first else self._logprobs(choice)
        if self.req.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            tools = self.req.tools
            if not first and (choice.reasoning is not None or tools is not None):
                content = text
                if choice.reasoning is not None:  # thinking first; what follows is the answer
                    part = reasoning_delta(choice.reasoning, text, finish)
                    if "reasoning_content" in part:
                        delta["reasoning_content"] = part["reasoning_content"]
                    content = part.get("content")
                if tools is not None:  # the answer may be tool calls
                    stream = self._tool_streams.setdefault(choice.index, ToolStream(tools.fmt))
                    delta.update(stream.push(content or "", final=finish is not None))
                    if finish == "stop" and stream.called:
                        finish = "tool_calls"
                elif content:
                    delta["content"] = content
            elif text is not None:
                delta["content"] = text
            return {"index": choice.index, "delta": delta, "logprobs": lps,
                    "finish_reason": finish}
        return {"index": choice.index, "text": text or "", "logprobs": lps,
                "finish_reason": finish}

    def final_choice(self, choice: Choice) -> dict[str, Any]:
        lps = self._logprobs(choice)
        if self.req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            finish = choice.finish
            if choice.reasoning is not None:
                message.update(reasoning_message(choice.reasoning, choice.text))
            if self.req.tools is not None:
                content, calls = parse_output(self.req.tools.fmt, message["content"] or "")
                if calls:
                    message["content"] = content or None
                    message["tool_calls"] = [c.as_openai() for c in calls]
                    finish = "tool_calls" if finish == "stop" else finish
                elif message["content"] is not None:
                    message["content"] = content
            return {"index": choice.index, "message": message, "logprobs": lps,
                    "finish_reason": finish}
        return {"index": choice.index, "text": choice.text, "logprobs": lps,
                "finish_reason": choice.finish}
