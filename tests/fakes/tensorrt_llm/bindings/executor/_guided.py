"""Guided decoding: GuidedDecodingConfig (ExecutorConfig) and GuidedDecodingParams (Request).

Read from TensorRT-LLM's source (see docs/trtllm.md "Structured output"):
- cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp: `GuidedDecodingConfig(backend,
  encoded_vocab=None, tokenizer_str=None, stop_token_ids=None)`, read-write properties of the
  same names, nested enum `GuidedDecodingBackend` {XGRAMMAR, LLGUIDANCE};
- cpp/tensorrt_llm/nanobind/executor/request.cpp: `GuidedDecodingParams(guide_type,
  guide=None)`, read-only `guide_type` and `guide`, nested enum `GuideType` {JSON,
  JSON_SCHEMA, REGEX, EBNF_GRAMMAR, STRUCTURAL_TAG};
- cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp: the C++ runtime (the engine path) refuses
  LLGUIDANCE at construction, builds xgrammar's TokenizerInfo from encoded_vocab (and the
  tokenizer_str's metadata when given, else a RAW vocabulary) at the engine's padded vocab
  size, compiles JSON (the built-in JSON grammar), JSON_SCHEMA (CompileJSONSchema with its
  defaults), REGEX and EBNF_GRAMMAR at a request's first context step, and has no branch for
  STRUCTURAL_TAG;
- cpp/tensorrt_llm/executor/executorImpl.cpp (fetchNewRequests): a request with
  GuidedDecodingParams on an Executor without a GuidedDecoder gets an error response.

The fake honours the guide with the installed xgrammar: the toy's candidates are walked in
its order of preference and the first the grammar allows is taken.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

from ._typed import Typed

ERR = "[TensorRT-LLM][ERROR] "
NO_DECODER = (
    "Encountered an error when fetching new request: " + ERR + "Assertion failed: Request is "
    "specified with GuidedDecodingParams, but GuidedDecoder is not setup. Please provide a "
    "valid GuidedDecodingConfig to setup GuidedDecoder."
)
NO_LLGUIDANCE = ERR + "Assertion failed: LLGuidance is not supported for guided decoding in " \
    "C++ runtime."
BEAM_SEARCH = "Guided decoding does not support with beam search."
FORWARD_ERROR = "Encountered an error in forwardAsync function: "
# guidedDecoder.cpp has no branch for it: no matcher is made for the request, and the next
# bitmask fill dereferences none (or the slot's previous one). The fake refuses it loudly.
STRUCTURAL_TAG = ("fake TensorRT-LLM: the C++ GuidedDecoder (engine path) has no "
                  "STRUCTURAL_TAG branch; its behaviour is undefined")


def _str_list(value: Any, what: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise TypeError(f"{what}: incompatible value (expected list[str] | None)")
    return list(value)


def _int_list(value: Any, what: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError(f"{what}: incompatible value (expected list[int] | None)")
    return list(value)


class GuidedDecodingConfig(Typed):
    class GuidedDecodingBackend(Enum):
        XGRAMMAR = 0
        LLGUIDANCE = 1

    _TYPES = {"tokenizer_str": (str, None)}  # noqa: RUF012
    __slots__ = ("_encoded_vocab", "_stop_token_ids", "backend", "tokenizer_str")

    def __init__(self, backend: GuidedDecodingBackend, encoded_vocab: list[str] | None = None,
                 tokenizer_str: str | None = None,
                 stop_token_ids: list[int] | None = None) -> None:
        self.backend = backend
        self.encoded_vocab = encoded_vocab
        self.tokenizer_str = tokenizer_str
        self.stop_token_ids = stop_token_ids

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "backend" and not isinstance(value, GuidedDecodingConfig.GuidedDecodingBackend):
            raise TypeError(f"GuidedDecodingConfig.backend: incompatible value {value!r} "
                            "(expected GuidedDecodingConfig.GuidedDecodingBackend)")
        Typed.__setattr__(self, name, value)

    @property
    def encoded_vocab(self) -> list[str] | None:
        return self._encoded_vocab

    @encoded_vocab.setter
    def encoded_vocab(self, value: Any) -> None:
        object.__setattr__(self, "_encoded_vocab",
                           _str_list(value, "GuidedDecodingConfig.encoded_vocab"))

    @property
    def stop_token_ids(self) -> list[int] | None:
        return self._stop_token_ids

    @stop_token_ids.setter
    def stop_token_ids(self, value: Any) -> None:
        object.__setattr__(self, "_stop_token_ids",
                           _int_list(value, "GuidedDecodingConfig.stop_token_ids"))


class GuidedDecodingParams:
    class GuideType(Enum):
        JSON = 0
        JSON_SCHEMA = 1
        REGEX = 2
        EBNF_GRAMMAR = 3
        STRUCTURAL_TAG = 4

    __slots__ = ("_guide", "_guide_type")

    def __init__(self, guide_type: GuideType, guide: str | None = None) -> None:
        if not isinstance(guide_type, GuidedDecodingParams.GuideType):
            raise TypeError(f"GuidedDecodingParams(): guide_type must be a "
                            f"GuidedDecodingParams.GuideType, got {guide_type!r}")
        if guide is not None and not isinstance(guide, str):
            raise TypeError(f"GuidedDecodingParams(): guide must be str | None, got {guide!r}")
        self._guide_type, self._guide = guide_type, guide

    @property
    def guide_type(self) -> GuideType:  # read-only (def_prop_ro)
        return self._guide_type

    @property
    def guide(self) -> str | None:
        return self._guide

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, GuidedDecodingParams)
                and (self._guide_type, self._guide) == (other._guide_type, other._guide))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GuidedDecodingParams({self._guide_type}, guide={self._guide!r})"


class GuidedDecoder:
    """The leader's grammar state (guidedDecoder.cpp), with the installed xgrammar."""

    def __init__(self, cfg: GuidedDecodingConfig, vocab_size_padded: int) -> None:
        if cfg.backend is GuidedDecodingConfig.GuidedDecodingBackend.LLGUIDANCE:
            raise RuntimeError(NO_LLGUIDANCE)
        if cfg.encoded_vocab is None:
            raise RuntimeError("bad optional access")  # getEncodedVocab().value()
        import xgrammar as xgr

        if cfg.tokenizer_str is not None:  # TokenizerInfo::FromHuggingFace
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(cfg.tokenizer_str)
            info = xgr.TokenizerInfo(cfg.encoded_vocab, vocab_type=meta["vocab_type"],
                                     vocab_size=vocab_size_padded,
                                     stop_token_ids=cfg.stop_token_ids,
                                     add_prefix_space=meta["add_prefix_space"])
        else:
            info = xgr.TokenizerInfo(cfg.encoded_vocab, vocab_type=xgr.VocabType.RAW,
                                     vocab_size=vocab_size_padded,
                                     stop_token_ids=cfg.stop_token_ids)
        self.vocab_size = vocab_size_padded
        self._compiler = xgr.GrammarCompiler(info)

    def matcher(self, params: GuidedDecodingParams) -> Any:
        """A matcher for a request's first context step; raises what xgrammar raises."""
        import xgrammar as xgr

        t, guide = params.guide_type, params.guide
        T = GuidedDecodingParams.GuideType
        if t is T.JSON:
            return xgr.GrammarMatcher(self._compiler.compile_builtin_json_grammar())
        if guide is None:
            raise RuntimeError("bad optional access")  # guide.value()
        if t is T.JSON_SCHEMA:
            json.loads(guide)
            return xgr.GrammarMatcher(self._compiler.compile_json_schema(guide))
        if t is T.REGEX:
            return xgr.GrammarMatcher(self._compiler.compile_grammar(
                xgr.Grammar.from_regex(guide)))
        if t is T.EBNF_GRAMMAR:
            return xgr.GrammarMatcher(self._compiler.compile_grammar(
                xgr.Grammar.from_ebnf(guide)))
        raise NotImplementedError(STRUCTURAL_TAG)  # refused at enqueue (_responses.py)

    @staticmethod
    def allowed(matcher: Any, vocab_size: int) -> Any:
        """The tokens the grammar allows next, as a predicate over token ids."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].tolist()
        return lambda t: 0 <= t < vocab_size and bool((words[t // 32] >> (t % 32)) & 1)
