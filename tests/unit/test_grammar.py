"""Grammar-constrained sampling (xgrammar) on a real tokenizer with random logits: whatever
the logits, the sampled text is valid (checked with jsonschema, re, json)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from runtime.core.grammar import (
    GrammarCompiler,
    GrammarConfig,
    GrammarError,
    GrammarState,
    GrammarTimeout,
)
from runtime.core.logits import SeqSampling
from runtime.core.sampler import Sampler, make_generator
from runtime.core.types import GuidedSpec, SamplingParams
from tests.unit.test_detok import build_tiny_tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
     "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "maxItems": 2,
                                               "items": {"type": "string", "maxLength": 3}}},
     "required": ["ok", "tags"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok, len(tok) + 2, [tok.eos_token_id])  # a padded model vocab


def generate(tok, compiler: GrammarCompiler, spec: GuidedSpec, seed: int,
             params: SamplingParams | None = None, max_tokens: int = 200) -> str:
    """Sample with random logits under the grammar until the eos token."""
    eos = tok.eos_token_id
    params = params or SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens)
    state = SeqSampling(params, make_generator(params), [eos], [1, 2],
                        GrammarState(compiler.compile(spec), [eos]))
    logits_gen = torch.Generator().manual_seed(seed)
    sampler, out = Sampler(), []
    for _ in range(max_tokens):
        logits = torch.randn(1, compiler.vocab_size, generator=logits_gen) * 3
        ((token, _),) = sampler.sample_seqs(logits, [state])
        state.accept(token, None)
        assert not state.grammar_violated
        if token == eos:
            return tok.decode(out)
        out.append(token)
    raise AssertionError(f"no end within {max_tokens} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "enum-array", "nested"])
@pytest.mark.parametrize("seed", range(3))
def test_json_schema_output_validates(tok, compiler, schema, seed: int) -> None:
    text = generate(tok, compiler, GuidedSpec("json_schema", json.dumps(schema)), seed)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice(tok, compiler) -> None:
    # Unconstrained strings end only when '"' is drawn: favour it, and the closing brace.
    bias = tuple((tok.convert_tokens_to_ids(c), 6.0) for c in ('"', "}"))
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, logit_bias=bias)
        obj = json.loads(generate(tok, compiler, GuidedSpec("json_object"), seed, params))
        assert isinstance(obj, dict)
        text = generate(tok, compiler, GuidedSpec("regex", r"[a-c]{2,4}-[0-9]{1,3}"), seed)
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", text)
        text = generate(tok, compiler, GuidedSpec("choice", json.dumps(["yes", "no", "ça va"])),
                        seed)
        assert text in ("yes", "no", "ça va")


def test_compiled_grammars_are_cached_per_spec(tok) -> None:
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    spec = GuidedSpec("json_schema", json.dumps(SCHEMAS[0]))
    assert compiler.compile(spec) is compiler.compile(GuidedSpec("json_schema",
                                                                 json.dumps(SCHEMAS[0])))
    assert compiler.cache_size == 1


def big_schema(n: int = 700, tag: str = "") -> str:
    """Issue 37's red-team schema: n patterned strings (63 KB at 700), 300 required. Against
    SmolLM2's vocabulary it compiled in 131.9 s; against the tiny test vocabulary in ~3 s."""
    props = {f"f{i}": {"type": "string",
                       "pattern": f"^[a-z]{{1,40}}@[a-z]{{1,30}}\\.(com|org|net{i}{tag})$"}
             for i in range(n)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)[:300]})


def test_a_compile_past_its_deadline_is_a_grammar_timeout_and_finishes_into_the_cache(
        tok) -> None:
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    spec = GuidedSpec("json_schema", big_schema())
    t0 = time.monotonic()
    with pytest.raises(GrammarTimeout, match=r"0\.2 s"):
        compiler.compile(spec, timeout=0.2)
    assert time.monotonic() - t0 < 1.0
    assert compiler.stats().in_flight == 1  # abandoned, running on, counted
    deadline = time.monotonic() + 60
    while compiler.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = compiler.stats()
    assert stats.in_flight == 0 and stats.cache_entries == 1 and stats.cache_bytes > 1 << 20
    t0 = time.monotonic()
    compiler.compile(spec, timeout=0.2)  # the retry is a cache hit
    assert time.monotonic() - t0 < 0.1


def test_compiles_run_on_a_bounded_pool_and_withdrawn_ones_never_run(tok) -> None:
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id],
                               GrammarConfig(compile_workers=1))
    slow = GuidedSpec("json_schema", big_schema(300))
    with pytest.raises(GrammarTimeout):
        compiler.compile(slow, timeout=0.05)  # runs on the one worker
    queued = [GuidedSpec("regex", f"a{i}b") for i in range(5)]
    for spec in queued:  # behind it: they time out, nobody waits, they are withdrawn
        with pytest.raises(GrammarTimeout):
            compiler.compile(spec, timeout=0.01)
    assert compiler.stats().in_flight == 1
    compiler.compile(GuidedSpec("regex", "x"))  # queued behind the slow one, then runs
    stats = compiler.stats()
    assert stats.in_flight == 0 and stats.compiled == 2  # the slow one and "x" only
    assert compiler.compile(queued[0], timeout=10) is not None  # asked again: compiled now


def test_the_cache_is_bounded_by_bytes_least_recently_used_first(tok) -> None:
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id],
                               GrammarConfig(cache_bytes=2 << 20))
    specs = [GuidedSpec("json_schema", big_schema(20, tag=f"x{k}")) for k in range(12)]
    first = compiler.compile(specs[0])
    for spec in specs[1:]:
        compiler.compile(specs[0])  # kept recent
        compiler.compile(spec)
        stats = compiler.stats()
        assert stats.cache_bytes <= 2 << 20
        # xgrammar keeps no second, unbounded copy of its own
        assert compiler._get_compiler()[0].get_cache_size_bytes() == 0
    assert compiler.stats().cache_entries < len(specs)
    assert compiler.compile(specs[0]) is first  # the recently used one survived
    with pytest.raises(ValueError, match="positive"):
        GrammarConfig(compile_timeout_s=0)


@pytest.mark.parametrize(("spec", "words"), [
    (GuidedSpec("json_schema", '{"type": 5}'), "string"),
    (GuidedSpec("json_schema", "{not json"), "not valid JSON"),
    (GuidedSpec("regex", "(unclosed"), "arenthes"),
    (GuidedSpec("grammar", "root ::= "), "xpect"),
])
def test_bad_specs_raise_grammar_error_with_the_reason(compiler, spec, words: str) -> None:
    with pytest.raises(GrammarError, match=words) as info:
        compiler.compile(spec)
    assert "/project/" not in str(info.value)  # xgrammar's source location is stripped


def test_min_tokens_yields_to_a_complete_grammar(tok, compiler) -> None:
    # The choice "no" is complete after two tokens at most; min_tokens 10 would forbid the
    # eos that is then the only token left: the grammar wins, the output still ends.
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, min_tokens=10)
    text = generate(tok, compiler, GuidedSpec("choice", '["no"]'), 1, params)
    assert text == "no"


def test_siblings_fork_the_grammar_position(tok, compiler) -> None:
    eos = tok.eos_token_id
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=50)
    state = SeqSampling(params, make_generator(params), [eos], [],
                        GrammarState(compiler.compile(GuidedSpec("regex", "ab|ac")), [eos]))
    a = tok.convert_tokens_to_ids("a")
    state.accept(a, None)
    child = state.fork(make_generator(params, 1))
    logits = torch.zeros(2, compiler.vocab_size)
    picks = Sampler().sample_seqs(logits, [state, child])
    assert {tok.decode([t]) for t, _ in picks} <= {"b", "c"}


def test_packed_words_follow_xgrammars_bit_order() -> None:
    from runtime.core.grammar import _pack

    allowed = torch.rand(100, generator=torch.Generator().manual_seed(0)) > 0.5
    words = _pack(allowed)
    assert words.dtype == torch.int32 and words.shape == (4,)
    bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()
    assert torch.equal(bits[:100], allowed) and not bits[100:].any()


def test_a_grammar_that_allows_nothing_ends_with_the_stop_token(tok, compiler) -> None:
    eos = tok.eos_token_id
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20)
    state = SeqSampling(params, make_generator(params), [eos], [],
                        GrammarState(compiler.compile(GuidedSpec("grammar", 'root ::= root "a"')),
                                     [eos]))
    ((token, _),) = Sampler().sample_seqs(torch.randn(1, compiler.vocab_size), [state])
    assert token == eos
