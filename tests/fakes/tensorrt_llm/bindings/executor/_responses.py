"""Enqueue validation and await_responses for the leader (reference §2.1 "Methods").

Overloads of await_responses, resolved by argument type as nanobind does:
    await_responses(timeout=None)        -> list[Response]        any request
    await_responses(id, timeout=None)    -> list[Response]        one request
    await_responses(ids, timeout=None)   -> list[list[Response]]  per request, in order
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from ..._fake import env
from ._guided import NO_DECODER, STRUCTURAL_TAG
from ._loop import Loop, Seq
from ._request import Request, Response

ALREADY_PROCESSED = "ReqId {} has already been processed and was terminated."


def _await_any(timeout: timedelta | None = None) -> None: ...
def _await_id(id: int, /, timeout: timedelta | None = None) -> None: ...
def _await_ids(ids: list[int], /, timeout: timedelta | None = None) -> None: ...


AWAIT_OVERLOADS = (_await_any, _await_id, _await_ids)


def resolve_await(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, timedelta | None]:
    """-> (None | id | ids, timeout); TypeError when no overload accepts the arguments."""
    import inspect

    for fn in AWAIT_OVERLOADS:
        try:
            bound = inspect.signature(fn).bind(*args, **kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        target = bound.arguments.get("id", bound.arguments.get("ids"))
        timeout = bound.arguments["timeout"]
        if timeout is not None and not isinstance(timeout, timedelta):
            continue
        if fn is _await_id and not (isinstance(target, int) and not isinstance(target, bool)):
            continue
        if fn is _await_ids and not (
            isinstance(target, list) and all(isinstance(i, int) for i in target)
        ):
            continue
        return target, timeout
    raise TypeError(
        "await_responses(): incompatible function arguments. Supported: (timeout: "
        "datetime.timedelta | None = None), (id: int, timeout=None), (ids: list[int], "
        f"timeout=None); got args={args!r} kwargs={kwargs!r}"
    )


def enqueue(loop: Loop, requests: list[Request], next_id: int) -> list[int]:
    """Caller holds loop.cond. Overflow raises before any request is queued."""
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(f"expected a tensorrt_llm.bindings.executor.Request, got {r!r}")
        _check_supported(r)
    limit = loop.cfg.max_queue_size
    if limit is not None and len(loop.queued) + len(requests) > limit:
        raise RuntimeError(f"Maximum queue size of {limit} has been reached")
    ids = []
    now = time.monotonic()
    for i, r in enumerate(requests):
        rid = next_id + i
        ids.append(rid)
        error, max_tokens = _validate(loop, r)
        if error is not None:
            loop.ready.append(Response(rid, error_msg=error, client_id=r.client_id))
            continue
        n = len(r.input_token_ids) + max_tokens
        loop.queued.append(Seq(rid, r, max_tokens, loop.blocks_for(n), now))
    loop.cond.notify_all()
    return ids


def _check_supported(r: Request) -> None:
    """Documented features the toy model cannot honour: refuse loudly, never ignore."""
    sc = r.sampling_config
    if sc.beam_width != 1 or r.num_return_sequences != 1 or (sc.num_return_sequences or 1) != 1:
        raise NotImplementedError("the TensorRT-LLM fake supports beam width 1, one sequence")
    oc = r.output_config
    if oc.return_context_logits or oc.return_generation_logits or oc.return_encoder_output:
        raise NotImplementedError("the TensorRT-LLM fake returns no logits or encoder output")


def _validate(loop: Loop, r: Request) -> tuple[str | None, int]:
    """-> (error message for an error Response, max_tokens clamped to max_seq_len). The limits
    are the engine's, or smaller when the KV cache made the Executor shrink them."""
    n_in = len(r.input_token_ids)
    if r.guided_decoding_params is not None and loop.guided is None:
        # executorImpl.cpp fetchNewRequests: an error response, not an exception at enqueue.
        return NO_DECODER, 0
    if (r.guided_decoding_params is not None
            and r.guided_decoding_params.guide_type.name == "STRUCTURAL_TAG"):
        return STRUCTURAL_TAG, 0
    if n_in == 0:
        return "Input token ids are empty", 0
    if n_in > loop.max_input_len:
        return f"Prompt length ({n_in}) exceeds maximum input length ({loop.max_input_len})", 0
    if r.max_tokens < 1:
        return f"max_tokens ({r.max_tokens}) must be at least 1", 0
    if any(t < 0 or t >= loop.eng.toy.vocab_size for t in r.input_token_ids):
        return f"Input token ids must be in [0, {loop.eng.toy.vocab_size})", 0
    max_tokens = r.max_tokens
    if n_in + max_tokens > loop.max_seq_len:
        max_tokens = loop.max_seq_len - n_in
        env.log(
            "WARNING",
            f"Number of requested output tokens ({r.max_tokens}) exceeds maximum "
            f"sequence length ({loop.max_seq_len}). Number of requested output tokens is "
            f"changed to ({max_tokens}).",
        )
        if max_tokens < 1:
            return f"Prompt length ({n_in}) leaves no room in max_seq_len", 0
    return None, max_tokens


def await_responses(loop: Loop, target: Any, timeout: timedelta | None) -> list[Any]:
    if isinstance(target, list):  # one wait per id, in order, each with the full timeout
        return [_await(loop, rid, timeout) for rid in target]
    return _await(loop, target, timeout)


def _await(loop: Loop, rid: int | None, timeout: timedelta | None) -> list[Response]:
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout.total_seconds()
    with loop.cond:
        while True:
            out = [r for r in loop.ready if rid is None or r.request_id == rid]
            if out:
                for r in out:
                    loop.ready.remove(r)
                    if r.has_error() or r.result.is_final:
                        loop.delivered_final.add(r.request_id)
                return out
            if rid is not None and rid in loop.delivered_final:
                return [Response(rid, error_msg=ALREADY_PROCESSED.format(rid))]
            if loop.stopped:
                return []
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return []
            if deadline is None and now - start > env.await_limit_s():
                raise RuntimeError(
                    f"fake TensorRT-LLM: await_responses(timeout=None) blocked {env.await_limit_s()}"
                    " s with nothing arriving (FAKE_TRTLLM_AWAIT_LIMIT_S); the real one would hang"
                )
            loop.cond.wait(0.05 if deadline is None else min(0.05, deadline - now))
