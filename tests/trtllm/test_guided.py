"""Structured output on the trtllm backend: our GuidedSpec -> TensorRT-LLM's
GuidedDecodingParams, the GuidedDecodingConfig built from the engine's tokenizer, and the
contract fake's guided decoding (as strict as TensorRT-LLM's source; docs/trtllm.md
"Structured output"), which constrains the toy's output with xgrammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from runtime.core.types import GuidedSpec, SamplingParams, UnsupportedParameter
from tests.trtllm.test_adapter import _Sink

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                           "n": {"type": "integer"}},
          "required": ["city", "n"], "additionalProperties": False}


@pytest.fixture
def guided_adapter(trtllm_fake: ModuleType, engine_tp1: Path) -> Iterator[Any]:
    from runtime.executors.trtllm import TrtllmExecutor
    from runtime.executors.trtllm_setup import (
        construct_executor,
        guided_decoding_config,
        kv_cache_config,
    )

    guided, off = guided_decoding_config(engine_tp1)
    assert off is None
    eos = tuple(guided.stop_token_ids)
    a = TrtllmExecutor(construct_executor(engine_tp1, kv_cache_config(None, 1024), guided),
                       eos_token_ids=eos, pad_id=eos[0], guided_unavailable=None)
    try:
        yield a
    finally:
        a.shutdown()


def _tx() -> ModuleType:
    import importlib

    return importlib.import_module("tensorrt_llm.bindings.executor")


def _text(engine: Path, tokens: list[int]) -> str:
    from runtime.tokenizer import FastTokenizer

    return FastTokenizer(engine).decode(tokens, skip_special_tokens=True)


# ---- the mapping -------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "kind", "guide"), [
    (GuidedSpec("json_object"), "EBNF_GRAMMAR", "compact:" + '{"type": "object"}'),
    (GuidedSpec("json_schema", json.dumps(SCHEMA)), "EBNF_GRAMMAR", "compact:" + json.dumps(SCHEMA)),
    (GuidedSpec("regex", "[a-c]+"), "REGEX", "[a-c]+"),
    (GuidedSpec("grammar", 'root ::= "x" | "y"'), "EBNF_GRAMMAR", 'root ::= "x" | "y"'),
    (GuidedSpec("choice", json.dumps(["yes", 'no "way"'])), "EBNF_GRAMMAR",
     'root ::= "yes" | "no \\"way\\""'),
])
def test_each_guided_kind_maps_onto_a_guide_type_the_cpp_runtime_compiles(
        trtllm_fake: ModuleType, spec: GuidedSpec, kind: str, guide: str) -> None:
    from runtime.executors.trtllm_request import compact_json_ebnf, make_request

    if guide.startswith("compact:"):
        guide = compact_json_ebnf(guide.removeprefix("compact:"))
    tx = _tx()
    req = make_request(tx, [1, 2], SamplingParams(max_tokens=4, temperature=0.0, guided=spec),
                       (0,), 0, guided_unavailable=None)
    gp = req.guided_decoding_params
    assert isinstance(gp, tx.GuidedDecodingParams)
    assert (gp.guide_type.name, gp.guide) == (kind, guide)
    plain = make_request(tx, [1], SamplingParams(max_tokens=2), (0,), 0, guided_unavailable=None)
    assert plain.guided_decoding_params is None


def test_guided_is_refused_naming_the_reason_without_a_config(trtllm_fake: ModuleType) -> None:
    from runtime.executors.trtllm_request import make_request

    tx = _tx()
    params = SamplingParams(max_tokens=4, guided=GuidedSpec("regex", "a"))
    with pytest.raises(UnsupportedParameter) as err:
        make_request(tx, [1], params, (0,), 0, guided_unavailable="no tokenizer.json")
    assert err.value.param == "guided" and "no tokenizer.json" in str(err.value)


def test_the_config_is_built_as_tensorrt_llms_llm_api_builds_it(
        trtllm_fake: ModuleType, engine_tp1: Path) -> None:
    from runtime.executors.trtllm_setup import guided_decoding_config
    from runtime.tokenizer import FastTokenizer

    cfg, off = guided_decoding_config(engine_tp1)
    tok = FastTokenizer(engine_tp1)
    vocab = tok.get_vocab()
    assert off is None
    assert cfg.backend is _tx().GuidedDecodingConfig \
        .GuidedDecodingBackend.XGRAMMAR
    assert cfg.encoded_vocab == sorted(vocab, key=vocab.__getitem__)  # tokens by id
    assert cfg.tokenizer_str == tok._tok.to_str()
    assert tok.eos_token_id in cfg.stop_token_ids


# ---- the fake, as strict as TensorRT-LLM -------------------------------------------------

def test_fake_guided_classes_have_tensorrt_llms_names_and_types(trtllm_fake: ModuleType) -> None:
    tx = _tx()
    gdc, gdp = tx.GuidedDecodingConfig, tx.GuidedDecodingParams
    assert [m.name for m in gdc.GuidedDecodingBackend] == ["XGRAMMAR", "LLGUIDANCE"]
    assert [m.name for m in gdp.GuideType] == ["JSON", "JSON_SCHEMA", "REGEX", "EBNF_GRAMMAR",
                                                "STRUCTURAL_TAG"]
    p = gdp(gdp.GuideType.REGEX, guide="a+")
    with pytest.raises(AttributeError):
        p.guide = "b"  # read-only (def_prop_ro)
    for bad in (lambda: gdp("REGEX", "a"), lambda: gdp(gdp.GuideType.REGEX, 3),
                lambda: gdc("xgrammar"),
                lambda: gdc(gdc.GuidedDecodingBackend.XGRAMMAR, encoded_vocab="abc"),
                lambda: gdc(gdc.GuidedDecodingBackend.XGRAMMAR, stop_token_ids=[True]),
                lambda: tx.ExecutorConfig(guided_decoding_config={"backend": "xgrammar"}),
                lambda: tx.Request([1], 2, guided_decoding_params="a+")):
        with pytest.raises(TypeError):
            bad()
    with pytest.raises(TypeError):
        gdp(guide_type=gdp.GuideType.JSON, schema="{}")  # no such keyword
    with pytest.raises(RuntimeError, match="Guided decoding does not support with beam search"):
        tx.Request([1], 2, sampling_config=tx.SamplingConfig(2), guided_decoding_params=p)


def test_fake_executor_without_a_config_answers_a_guided_request_with_an_error(
        trtllm_fake: ModuleType, engine_tp1: Path) -> None:
    from datetime import timedelta

    from runtime.executors.trtllm_setup import construct_executor, kv_cache_config

    tx = _tx()
    ex = construct_executor(engine_tp1, kv_cache_config(None, 1024))
    try:
        gp = tx.GuidedDecodingParams(tx.GuidedDecodingParams.GuideType.JSON)
        rid = ex.enqueue_request(tx.Request([1, 2], 4, guided_decoding_params=gp))
        (resp,) = ex.await_responses(rid, timeout=timedelta(seconds=5))
        assert resp.has_error()
        assert "GuidedDecoder is not setup. Please provide a valid GuidedDecodingConfig" \
            in resp.error_msg
    finally:
        ex.shutdown()


def test_fake_refuses_llguidance_at_construction(trtllm_fake: ModuleType,
                                                 engine_tp1: Path) -> None:
    from runtime.executors.trtllm_setup import (
        construct_executor,
        guided_decoding_config,
        kv_cache_config,
    )

    cfg, _ = guided_decoding_config(engine_tp1)
    cfg.backend = type(cfg).GuidedDecodingBackend.LLGUIDANCE
    with pytest.raises(RuntimeError, match="LLGuidance is not supported"):
        construct_executor(engine_tp1, kv_cache_config(None, 1024), cfg)


def test_a_guide_that_does_not_compile_ends_every_active_request(
        guided_adapter: Any) -> None:
    """guidedDecoder.cpp compiles in forwardAsync; its exception terminates the whole active
    batch (executorImpl.cpp terminateActiveRequests). Our server compiles every guide with
    xgrammar before it reaches the adapter, so a bad guide never gets this far there."""
    long, bad = _Sink(), _Sink()
    guided_adapter.add_request("long", [3, 4], SamplingParams(max_tokens=200, temperature=0.0,
                                                               ignore_eos=True), long)
    guided_adapter.add_request("bad", [3, 4], SamplingParams(
        max_tokens=8, temperature=0.0, guided=GuidedSpec("grammar", "root ::= undefined")),
        bad)
    assert bad.done.wait(10) and long.done.wait(10)
    for sink in (bad, long):
        assert "Encountered an error in forwardAsync function" in (sink.events[-1].error or "")


# ---- constrained output, end to end through the adapter ----------------------------------

@pytest.mark.parametrize("spec", [
    GuidedSpec("json_schema", json.dumps(SCHEMA)),
    GuidedSpec("json_object"),
    GuidedSpec("choice", json.dumps(["alpha", "beta", "gamma"])),
    GuidedSpec("regex", "[0-9]{3}-[a-z]{2}"),
])
def test_the_fake_constrains_its_output_to_the_guide(guided_adapter: Any, engine_tp1: Path,
                                                     spec: GuidedSpec) -> None:
    import re

    import jsonschema

    [(tokens, finish)] = guided_adapter.generate(
        [[5, 17, 33]], [SamplingParams(max_tokens=120, temperature=0.0, guided=spec)])
    text = _text(engine_tp1, tokens)
    if spec.kind == "json_object":
        # Any object: the toy never closes it within max_tokens, but every token kept it a
        # valid prefix (here: a key that runs on).
        assert text.startswith("{"), text
        return
    assert finish == "stop", (finish, text)  # the grammar completed and allowed the eos
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "choice":
        assert text in ("alpha", "beta", "gamma")
    else:
        assert re.fullmatch(spec.value, text), text


def test_min_tokens_with_structured_output_is_refused(guided_adapter: Any) -> None:
    guided_adapter.eos_token_ids = (*guided_adapter.eos_token_ids, 7)  # a second stop id
    with pytest.raises(UnsupportedParameter) as err:
        guided_adapter.add_request("m", [1, 2], SamplingParams(
            max_tokens=8, min_tokens=2, guided=GuidedSpec("regex", "a+")), _Sink())
    assert err.value.param == "min_tokens"
