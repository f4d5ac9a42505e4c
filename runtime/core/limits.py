"""The limits on one request, and the ids that stop it: decided here, once, for every layer.

The HTTP layer (serve/api/prompt.py) calls these to answer a client with a 400 naming the
field; the scheduler (runtime/core/scheduler.py) and TensorRT-LLM's request builder
(runtime/executors/trtllm_request.py) apply the same rules to what they are given rather
than restating them, so a limit or the stop-id set cannot differ between layers.
"""

from __future__ import annotations

from collections.abc import Sequence


class LimitError(ValueError):
    """A request over a limit: the message for the client, the request field it concerns
    (`param`) and an OpenAI-style error code."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def output_budget(prompt_len: int, max_tokens: int | None, min_tokens: int, max_seq_len: int,
                  prompt_param: str = "prompt") -> int:
    """The tokens a request may generate: its max_tokens, or when it gave none every
    position the context has left. Raises LimitError when the prompt, or prompt plus
    max_tokens, does not fit the context, or min_tokens exceeds the budget. A budget of 0
    (completions with echo: the prompt's log-probabilities only) is allowed."""
    if prompt_len >= max_seq_len:
        raise LimitError(f"the prompt has {prompt_len} tokens but this model's maximum "
                         f"context length is {max_seq_len} tokens (prompt plus output)",
                         prompt_param, "context_length_exceeded")
    budget = max_tokens if max_tokens is not None else max_seq_len - prompt_len
    if prompt_len + budget > max_seq_len:
        raise LimitError(f"prompt tokens ({prompt_len}) + max_tokens ({budget}) = "
                         f"{prompt_len + budget} exceeds the maximum context length of "
                         f"{max_seq_len} tokens", "max_tokens", "context_length_exceeded")
    if min_tokens > max(budget, 0):
        raise LimitError(f"'min_tokens' ({min_tokens}) exceeds max_tokens ({budget})",
                         "min_tokens", "invalid_value")
    return budget


def stop_ids(eos_token_ids: Sequence[int], stop_token_ids: Sequence[int],
             ignore_eos: bool) -> tuple[int, ...]:
    """The ids that end a request: the engine's end-of-sequence ids (unless it asked to
    ignore them) then its own stop ids, de-duplicated, eos first (TensorRT-LLM takes the
    first as its end id). With ignore_eos the eos ids are left out altogether, so the
    request runs to max_tokens whichever way an executor reads the flag."""
    eos = () if ignore_eos else tuple(eos_token_ids)
    return tuple(dict.fromkeys((*eos, *stop_token_ids)))
