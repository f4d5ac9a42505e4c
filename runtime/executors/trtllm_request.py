"""Our SamplingParams -> a TensorRT-LLM Request, and what comes back -> our log-probabilities.

Written against shared/reference/tensorrt-llm-1.2-api.md §2.1 (Request, SamplingConfig,
OutputConfig). `tx` is `tensorrt_llm.bindings.executor` (trtllm_setup.bindings()).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from types import ModuleType
from typing import Any

from runtime.core.limits import stop_ids
from runtime.core.types import GuidedSpec, SamplingParams, TokenLogprob, UnsupportedParameter

SEED_BITS = 63  # SamplingConfig.seed is a uint64; below 2**63 it fits a signed one too
NO_GUIDED_CONFIG = "the Executor was constructed without a GuidedDecodingConfig"


def other_stop_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> list[int]:
    """The stop ids that are not the Request's end_id. TensorRT-LLM's min_tokens masks end_id
    alone (penaltyKernels.cu: `outLogitsPtr[endIds[batchSlot]] = MASK_VAL`), so these, sent as
    stop words, could end a request before min_tokens (Llama 3's <|eot_id|>)."""
    eos = () if params.ignore_eos else eos_token_ids
    stops = stop_ids(eos_token_ids, params.stop_token_ids, params.ignore_eos)
    return [t for t in stops if not eos or t != eos[0]]


def min_tokens_phases(params: SamplingParams,
                      eos_token_ids: tuple[int, ...]) -> tuple[SamplingParams, list[list[int]]] | None:
    """(first phase's params, its bad words) when min_tokens needs two Requests, else None.

    Our min_tokens masks every stop id (runtime/core/logits.py). A Request's bad words hold for
    all of it, so the first min_tokens tokens are a Request of their own with the other stop
    ids as bad words; the rest continues from prompt + those tokens (`continuation`)."""
    others = other_stop_ids(params, eos_token_ids)
    if params.min_tokens == 0 or not others:
        return None
    return replace(params, max_tokens=params.min_tokens), [[t] for t in others]


def continuation(params: SamplingParams, produced: int) -> SamplingParams:
    """The second phase: what is left of max_tokens, no min_tokens, a seed of its own (derived,
    so a seeded request stays reproducible)."""
    seed = None if params.seed is None else (params.seed + produced) % 2**SEED_BITS
    return replace(params, max_tokens=params.max_tokens - produced, min_tokens=0, seed=seed)


def make_request(tx: ModuleType, prompt: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], pad_id: int,
                 bad_words: list[list[int]] | None = None,
                 guided_unavailable: str | None = NO_GUIDED_CONFIG) -> Any:
    """Our SamplingParams -> a TensorRT-LLM Request (streaming, prompt excluded).

    Mapped: repetition_penalty, min_tokens and seed (SamplingConfig), the chosen token's
    log-probability (OutputConfig.return_log_probs), structured output (GuidedDecodingParams,
    `guided_params`) when the Executor was constructed with a GuidedDecodingConfig
    (`guided_unavailable` None; else it says why not). Refused with UnsupportedParameter
    (a 400 naming the field): what the Executor cannot do as this adapter drives it
    (top alternatives, prompt log-probabilities, logit_bias, n > 1: that needs responses
    dispatched by sequence_index)."""
    refuse_unmapped(params, guided_unavailable)
    eos = () if params.ignore_eos else eos_token_ids
    stops = list(stop_ids(eos_token_ids, params.stop_token_ids, params.ignore_eos))
    # end_id ends generation and is not output; other stop ids become one-token stop
    # words (output, as our torch executor outputs its stop token; the HTTP layer hides
    # eos ids from the text either way).
    end_id = eos[0] if eos else None
    stop_words = [[t] for t in stops if t != end_id]
    # None leaves TensorRT-LLM's default (no penalty), as the neutral values mean.
    # TensorRT-LLM's greedy decoding is top_k=1 (temperature 0 is our spelling).
    greedy = params.greedy
    # Without a seed TensorRT-LLM seeds every request with 0, so identical prompts would
    # get identical "random" samples (NVIDIA/TensorRT-LLM #1000, #2411).
    seed = params.seed
    if seed is None and not greedy:
        seed = secrets.randbits(SEED_BITS)
    sampling = tx.SamplingConfig(
        beam_width=1, top_k=1 if greedy else params.top_k or None,
        top_p=None if greedy else float(params.top_p),
        temperature=None if greedy else float(params.temperature), seed=seed,
        min_tokens=params.min_tokens or None,
        # One to one: TensorRT-LLM's set (prompt and output tokens) is ours, and a division
        # commutes with the temperature it applies first. presence/frequency: refused above.
        repetition_penalty=_unless(params.repetition_penalty, 1.0),
    )
    return tx.Request(
        [int(t) for t in prompt], int(params.max_tokens),
        streaming=True,
        sampling_config=sampling,
        output_config=tx.OutputConfig(exclude_input_from_output=True,
                                      return_log_probs=params.logprobs is not None),
        end_id=end_id,
        pad_id=pad_id,
        stop_words=stop_words or None,
        bad_words=bad_words,
        priority=trtllm_priority(params.priority),  # 0 -> 0.5, TensorRT-LLM's default
        guided_decoding_params=None if params.guided is None else guided_params(tx, params.guided),
    )


# OpenAI's JSON mode: any JSON object (TensorRT-LLM's GuideType.JSON is xgrammar's built-in
# JSON grammar, whose root is an object OR an array).
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def compact_json_ebnf(schema: str) -> str:
    """A JSON Schema as EBNF for compact JSON, printed by our xgrammar. GuideType.JSON_SCHEMA
    would be compiled by TensorRT-LLM with CompileJSONSchema's defaults, which allow free
    whitespace between tokens, and a model can then stall in whitespace until max_tokens
    (the contract fake's toy does: test_guided.py); our torch backends generate compact JSON
    (runtime/core/grammar.py), and so does this."""
    import xgrammar as xgr

    json.loads(schema)
    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))


def guided_params(tx: ModuleType, spec: GuidedSpec) -> Any:
    """Our GuidedSpec -> TensorRT-LLM's GuidedDecodingParams: REGEX, or EBNF_GRAMMAR (JSON
    kinds as compact-JSON EBNF, choices as alternatives); never STRUCTURAL_TAG, for which
    the C++ runtime's GuidedDecoder (guidedDecoder.cpp) has no branch."""
    from runtime.core.grammar import choice_ebnf

    gt = tx.GuidedDecodingParams.GuideType
    if spec.kind in ("json_object", "json_schema"):
        schema = JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.value
        return tx.GuidedDecodingParams(gt.EBNF_GRAMMAR, guide=compact_json_ebnf(schema))
    if spec.kind == "regex":
        return tx.GuidedDecodingParams(gt.REGEX, guide=spec.value)
    if spec.kind == "grammar":
        return tx.GuidedDecodingParams(gt.EBNF_GRAMMAR, guide=spec.value)
    if spec.kind == "choice":
        return tx.GuidedDecodingParams(gt.EBNF_GRAMMAR, guide=choice_ebnf(spec.value))
    raise UnsupportedParameter("guided", f"guided decoding of kind {spec.kind!r} is not "
                               "supported by the trtllm backend")


def trtllm_priority(priority: int) -> float:
    """vLLM's integer priority (lower first, 0 the default) as TensorRT-LLM's Request
    priority (a float in [0, 1], higher first, 0.5 the default): strictly decreasing, so
    the order is kept (to float precision: integers beyond about 2**26 from 0 may tie)."""
    return 0.5 - 0.5 * priority / (abs(priority) + 1)


def _unless(value: float, neutral: float) -> float | None:
    return None if value == neutral else float(value)


# TensorRT-LLM's penalty kernel (penaltyKernels.cu, batchApplyPenalty) counts the prompt's
# tokens too (the context phase fills its penalty workspace with them) and subtracts after
# dividing by the temperature; ours (OpenAI's definition, runtime/core/logits.py) count only the
# output and subtract before it. The temperature could be folded in (penalty / T), the prompt
# cannot: a prompt token would be penalized before the request has output it.
_PROMPT_COUNTED = ("frequency_penalty * count and presence_penalty are subtracted for tokens "
                   "of the output only; TensorRT-LLM counts the prompt's tokens too, so")


def refuse_unmapped(params: SamplingParams, guided_unavailable: str | None = NO_GUIDED_CONFIG
                    ) -> None:
    refuse = [
        ("presence_penalty", params.presence_penalty != 0.0,
         f"{_PROMPT_COUNTED} presence_penalty is"),
        ("frequency_penalty", params.frequency_penalty != 0.0,
         f"{_PROMPT_COUNTED} frequency_penalty is"),
        ("logprobs", bool(params.logprobs), "top alternatives per token (only the chosen "
         "token's log-probability) are"),
        ("prompt_logprobs", params.prompt_logprobs is not None,
         "prompt log-probabilities (echo with logprobs) are"),
        ("logit_bias", bool(params.logit_bias), "logit_bias is"),
        # Tool calls under a grammar (tool_choice required or named, or a chat template
        # without tool support: the generic format) come here too, named by their field.
        ("guided", params.guided is not None and guided_unavailable is not None,
         f"grammar-constrained output (response_format, guided_*, and tool calls that need a "
         f"grammar) needs TensorRT-LLM's guided decoding, which is off here "
         f"({guided_unavailable}), so it is"),
        ("num_sequences", params.num_sequences > 1, "more than one sequence per request "
         "(n, best_of) is"),
    ]
    for name, asked, what in refuse:
        if asked:
            raise UnsupportedParameter(name, f"{what} not supported by the trtllm backend")


def chosen_logprobs(result: Any, tokens: list[int]) -> list[TokenLogprob] | None:
    """The chosen tokens' log-probabilities (return_log_probs): the last len(tokens)
    entries of the first sequence's list."""
    lps = result.log_probs
    if not lps or not tokens:
        return None
    values = [float(v) for v in lps[0]][-len(tokens):]
    return [TokenLogprob(t, v) for t, v in zip(tokens, values)]
