"""Request -> prompt token ids and SamplingParams (tokenizer-dependent validation).

Pure functions, run off the event loop (tokenizing a 1 MiB prompt takes long enough to
stall every other connection).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from runtime.core.limits import LimitError, output_budget, stop_ids
from runtime.core.types import SamplingParams
from serve.api.protocol import ApiError, GenerationRequest

GREEDY_EPS = 1e-5


def encode_prompts(req: GenerationRequest, tokenizer: Any, vocab_size: int | None = None
                   ) -> list[list[int]]:
    """Token ids of each prompt (a completion batch has several, chat one); chat requests
    go through the model's chat template.

    Every id must be one the model has an embedding for and the tokenizer can decode:
    below both the model's `vocab_size` and the tokenizer's length (they can differ,
    and an id between the two would fail inside the engine rather than here)."""
    if req.kind == "chat":
        batch = [_apply_chat_template(req, tokenizer)]
    else:
        batch = [list(p) if isinstance(p, tuple) else
                 list(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in req.prompts]
    param = "messages" if req.kind == "chat" else "prompt"
    vocab = model_vocab(tokenizer, vocab_size)
    for ids in batch:
        if not ids:
            raise ApiError(400, "the prompt encodes to zero tokens", param="prompt",
                           code="invalid_value")
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {bad} is out of range; the model's "
                           f"vocabulary has {vocab} tokens", param=param, code="invalid_value")
    return batch


def encode_prompt(req: GenerationRequest, tokenizer: Any, vocab_size: int | None = None
                  ) -> list[int]:
    """The first (for chat, the only) prompt's token ids."""
    return encode_prompts(req, tokenizer, vocab_size)[0]


def model_vocab(tokenizer: Any, vocab_size: int | None) -> int:
    """Ids below this are both embedded by the model and decodable by the tokenizer."""
    return len(tokenizer) if vocab_size is None else min(len(tokenizer), vocab_size)


def _apply_chat_template(req: GenerationRequest, tokenizer: Any) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions",
                       param="messages", code="no_chat_template")
    try:
        tools = req.tools.template_kwargs() if req.tools is not None else {}
        out = tokenizer.apply_chat_template([dict(m) for m in req.messages],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **tools)
    except Exception as exc:
        # Templates reject conversations with jinja's raise_exception (e.g. roles that
        # do not alternate); that is the client's input, so it is a 400 not a 500.
        raise ApiError(400, f"the chat template rejected the messages: {exc}",
                       param="messages", code="invalid_value") from None
    if isinstance(out, Mapping):  # older/newer transformers may still return a dict
        out = out["input_ids"]
    return [int(t) for t in out]


def build_sampling_params(req: GenerationRequest, prompt_len: int, max_seq_len: int,
                          eos_token_ids: Sequence[int], vocab: int | None = None
                          ) -> SamplingParams:
    """Check the context length and token ids, and build the executor's SamplingParams.

    max_tokens 0 (completions with echo: the prompt's log-probabilities only) runs one
    step, whose token the HTTP layer drops. `vocab` bounds logit_bias and stop_token_ids
    (the tokenizer's and model's smaller vocabulary, see `model_vocab`)."""
    # The limits themselves are runtime/core/limits.py's, which the scheduler applies too.
    try:
        max_tokens = output_budget(prompt_len, req.max_tokens, req.min_tokens, max_seq_len,
                                   "messages" if req.kind == "chat" else "prompt")
    except LimitError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None
    if vocab is not None:
        for name, ids in (("logit_bias", [t for t, _ in req.logit_bias]),
                          ("stop_token_ids", req.stop_token_ids)):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ApiError(400, f"'{name}' names token id {bad}; the model's vocabulary "
                               f"has {vocab} tokens", param=name, code="invalid_value")
    # The engine's eos ids (decided once, serve/rank0.py) and the request's own; with
    # ignore_eos, none of the eos ids (the benchmark relies on exact lengths).
    request_stop_ids = stop_ids(eos_token_ids, req.stop_token_ids, req.ignore_eos)
    # A temperature this small overflows logits / T; it means greedy anyway (as in vLLM).
    temperature = 0.0 if req.temperature < GREEDY_EPS else req.temperature
    echo_logprobs = req.echo and req.logprobs is not None
    return SamplingParams(
        max_tokens=max(max_tokens, 1), temperature=temperature, top_p=req.top_p,
        top_k=req.top_k, seed=req.seed, stop_token_ids=request_stop_ids, ignore_eos=req.ignore_eos,
        logit_bias=req.logit_bias, min_tokens=req.min_tokens,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, n=req.n, best_of=req.best_of,
        logprobs=req.logprobs if max_tokens > 0 else None,
        prompt_logprobs=req.logprobs if echo_logprobs else None, guided=req.guided,
        priority=req.priority)
