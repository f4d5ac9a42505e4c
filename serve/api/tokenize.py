"""POST /tokenize and POST /detokenize, in vLLM's shapes.

/tokenize: {"prompt": text} (add_special_tokens, default true) or {"messages": [...]} (the
chat template applied as /v1/chat/completions applies it; add_generation_prompt, default
true; add_special_tokens, default false: the template has them) -> {"count", "max_model_len",
"tokens", "token_strs"} (token_strs: the tokens' vocabulary strings with
return_token_strs: true, else null). /detokenize: {"tokens": [ids]} -> {"prompt": text}.
Both need only the tokenizer, so they answer as soon as it is loaded (before admission).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from serve.api.fields import bad, is_int, opt_bool, tname
from serve.api.generate import dumps, read_body, unavailable
from serve.api.prompt import model_vocab
from serve.api.protocol import (
    ApiError,
    _check_text,
    parse_chat_request,
    parse_json_body,
)
from serve.api.state import STATE_KEY, ServerState

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                             "add_generation_prompt", "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _refuse_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    for name, value in body.items():
        if name not in known and value is not None:
            raise bad(name, f"'{name}' is not supported by this endpoint; remove it",
                      "unsupported_parameter")


def _check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {tname(model)}", "invalid_type")
    if model != state.model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                       f"'{state.model_name}'", param="model", code="model_not_found")


def tokenize(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    """A validated /tokenize body -> its answer (runs off the event loop)."""
    tok = state.tokenizer
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if not has_prompt and not has_messages:
        raise bad("prompt", "'prompt' (text) or 'messages' (a chat) is required",
                  "missing_required_parameter")
    if has_prompt and has_messages:
        raise bad("messages", "give either 'prompt' or 'messages', not both")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad("prompt", f"'prompt' must be a string, got {tname(prompt)}",
                      "invalid_type")
        if body.get("add_generation_prompt") is not None:
            raise bad("add_generation_prompt", "'add_generation_prompt' applies to "
                      "'messages' only")
        special = opt_bool(body, "add_special_tokens", True)
        ids = list(tok(prompt, add_special_tokens=special)["input_ids"])
    else:
        # The chat endpoint's own validation (roles, text parts), errors naming 'messages'.
        req = parse_chat_request({"messages": body["messages"]})
        generation = opt_bool(body, "add_generation_prompt", True)
        special = opt_bool(body, "add_special_tokens", False)
        if not getattr(tok, "chat_template", None):
            raise bad("messages", "this model has no chat template; tokenize a 'prompt'",
                      "no_chat_template")
        try:
            text = tok.apply_chat_template([dict(m) for m in req.messages],
                                           add_generation_prompt=generation, tokenize=False)
        except Exception as exc:  # jinja's raise_exception: the client's conversation
            raise bad("messages", f"the chat template rejected the messages: {exc}") from None
        ids = list(tok(text, add_special_tokens=special)["input_ids"])
    strs = opt_bool(body, "return_token_strs", False)
    return {"count": len(ids), "max_model_len": state.max_seq_len, "tokens": ids,
            "token_strs": list(tok.convert_ids_to_tokens(ids)) if strs else None}


def detokenize(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("tokens")
    if tokens is None:
        raise bad("tokens", "'tokens' is required", "missing_required_parameter")
    if not isinstance(tokens, list) or not all(is_int(t) and t >= 0 for t in tokens):
        raise bad("tokens", "'tokens' must be an array of non-negative integers",
                  "invalid_type")
    vocab = model_vocab(state.tokenizer, state.vocab_size)
    over = next((t for t in tokens if t >= vocab), None)
    if over is not None:
        raise bad("tokens", f"token id {over} is out of range; the model's vocabulary has "
                  f"{vocab} tokens")
    return {"prompt": state.tokenizer.decode(tokens, skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)}


async def _answer(request: web.Request, known: frozenset[str], work: Any) -> web.Response:
    state = request.app[STATE_KEY]
    body = parse_json_body(await read_body(request, state.max_body_bytes))
    _check_text(body)
    _refuse_unknown(body, known)
    _check_model(state, body)
    if state.tokenizer is None:
        raise unavailable(state)
    out = await asyncio.get_running_loop().run_in_executor(None, work, state, body)
    return web.Response(text=dumps(out), content_type="application/json")


async def handle_tokenize(request: web.Request) -> web.Response:
    return await _answer(request, TOKENIZE_FIELDS, tokenize)


async def handle_detokenize(request: web.Request) -> web.Response:
    return await _answer(request, DETOKENIZE_FIELDS, detokenize)
