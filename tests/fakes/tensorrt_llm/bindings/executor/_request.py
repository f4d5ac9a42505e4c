"""Request, its sampling/output configs, and Response/Result (reference §2.1)."""

from __future__ import annotations

import copy
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from ._enums import FinishReason
from ._guided import BEAM_SEARCH, GuidedDecodingParams
from ._typed import Typed, int_list, int_lists

_OPT_INT = (int, None)
_OPT_FLOAT = (float, None)


@dataclass(slots=True)
class SamplingConfig(Typed):
    _TYPES = {  # noqa: RUF012
        "beam_width": (int,),
        "top_k": _OPT_INT,
        "top_p": _OPT_FLOAT,
        "temperature": _OPT_FLOAT,
        "min_tokens": _OPT_INT,
        "repetition_penalty": _OPT_FLOAT,
        "presence_penalty": _OPT_FLOAT,
        "frequency_penalty": _OPT_FLOAT,
        "length_penalty": _OPT_FLOAT,
        "seed": _OPT_INT,
        "num_return_sequences": _OPT_INT,
        "min_p": _OPT_FLOAT,
    }

    beam_width: int = 1
    _: KW_ONLY
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    seed: int | None = None
    num_return_sequences: int | None = None
    min_p: float | None = None


@dataclass(slots=True)
class OutputConfig(Typed):
    _TYPES = {  # noqa: RUF012
        "return_log_probs": (bool,),
        "return_context_logits": (bool,),
        "return_generation_logits": (bool,),
        "exclude_input_from_output": (bool,),
        "return_encoder_output": (bool,),
        "return_perf_metrics": (bool,),
    }

    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = False  # non-streaming results include the prompt
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: Any = None


_DEFAULT_SAMPLING = SamplingConfig()
_DEFAULT_OUTPUT = OutputConfig()


class Request(Typed):
    """Everything after max_tokens is keyword-only; there is no `max_new_tokens`, and
    `max_tokens` is read-only once the request exists (a nanobind read-only property)."""

    _TYPES = {  # noqa: RUF012
        "streaming": (bool,),
        "sampling_config": (SamplingConfig,),
        "output_config": (OutputConfig,),
        "end_id": _OPT_INT,
        "pad_id": _OPT_INT,
        "client_id": _OPT_INT,
        "return_all_generated_tokens": (bool,),
        "priority": (float,),
        "num_return_sequences": (int,),
        "allotted_time_ms": _OPT_INT,
        "guided_decoding_params": (GuidedDecodingParams, None),
    }
    __slots__ = (
        "_max_tokens",
        "allotted_time_ms",
        "bad_words",
        "client_id",
        "end_id",
        "guided_decoding_params",
        "input_token_ids",
        "num_return_sequences",
        "output_config",
        "pad_id",
        "position_ids",
        "priority",
        "return_all_generated_tokens",
        "sampling_config",
        "stop_words",
        "streaming",
    )  # fmt: skip

    def __init__(
        self,
        input_token_ids: list[int],
        max_tokens: int,
        *,
        streaming: bool = False,
        sampling_config: SamplingConfig = _DEFAULT_SAMPLING,
        output_config: OutputConfig = _DEFAULT_OUTPUT,
        end_id: int | None = None,
        pad_id: int | None = None,
        position_ids: list[int] | None = None,
        bad_words: list[list[int]] | None = None,
        stop_words: list[list[int]] | None = None,
        client_id: int | None = None,
        return_all_generated_tokens: bool = False,
        priority: float = 0.5,
        num_return_sequences: int = 1,
        guided_decoding_params: GuidedDecodingParams | None = None,
        allotted_time_ms: int | None = None,
    ) -> None:
        self.input_token_ids = int_list(input_token_ids, "Request.input_token_ids")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise TypeError(f"Request.max_tokens: incompatible value {max_tokens!r} (expected int)")
        object.__setattr__(self, "_max_tokens", max_tokens)
        self.streaming = streaming
        self.sampling_config = copy.copy(sampling_config)
        self.output_config = copy.copy(output_config)
        self.end_id = end_id
        self.pad_id = pad_id
        self.position_ids = None if position_ids is None else int_list(position_ids, "position_ids")
        self.bad_words = int_lists(bad_words, "Request.bad_words")
        self.stop_words = int_lists(stop_words, "Request.stop_words")
        self.client_id = client_id
        self.return_all_generated_tokens = return_all_generated_tokens
        self.priority = priority
        self.num_return_sequences = num_return_sequences
        self.guided_decoding_params = guided_decoding_params
        self.allotted_time_ms = allotted_time_ms
        if guided_decoding_params is not None and self.sampling_config.beam_width > 1:
            raise RuntimeError(BEAM_SEARCH)  # executor/request.cpp, Request::Impl

    @property
    def max_tokens(self) -> int:
        return self._max_tokens


@dataclass(slots=True)
class Result:
    is_final: bool
    output_token_ids: list[list[int]]  # one list per beam
    finish_reasons: list[FinishReason]  # one per beam
    decoding_iter: int
    cum_log_probs: list[float] | None = None
    log_probs: list[list[float]] | None = None
    context_logits: Any = None
    generation_logits: Any = None
    sequence_index: int = 0
    is_sequence_final: bool = False
    request_perf_metrics: Any = None
    additional_outputs: list[Any] = field(default_factory=list)


class Response:
    """One message from the executor: a Result, or an error (then `result` throws)."""

    __slots__ = ("_error_msg", "_result", "client_id", "request_id")

    def __init__(
        self,
        request_id: int,
        *,
        result: Result | None = None,
        error_msg: str | None = None,
        client_id: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self._result = result
        self._error_msg = error_msg

    def has_error(self) -> bool:
        return self._error_msg is not None

    @property
    def error_msg(self) -> str:
        if self._error_msg is None:
            raise RuntimeError("Cannot get the error message for a response without error")
        return self._error_msg

    @property
    def result(self) -> Result:
        if self._result is None:
            raise RuntimeError(
                f"Cannot get the result for a response with an error: {self._error_msg}"
            )
        return self._result

    def __repr__(self) -> str:
        body = f"error_msg={self._error_msg!r}" if self.has_error() else f"result={self._result}"
        return f"Response(request_id={self.request_id}, {body})"
