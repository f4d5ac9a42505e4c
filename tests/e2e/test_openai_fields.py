"""The fields OpenAI clients send, through the real `openai` client against the shared TP=2
server, each against an independent reference: transformers on the same weights (its
logits, its generate with its own logits processors, and seeded draws replayed from its
logits), jsonschema for structured output, and the server's own non-streamed answer for
streams. /metrics shows n > 1 sharing one prefill."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
import torch

from runtime.core.types import SamplingParams
from tests.e2e.conftest import MODEL, Reference
from tests.e2e.harness import Server
from tests.runtime.hf_reference import hf_model
from tests.runtime.test_sampling_features import _replay, hf_processors, hf_steps
from tests.unit.test_metrics import parse as parse_metrics

PROMPT = "The quick brown fox jumps over the lazy dog"
TOL = 2e-3  # log-probabilities: TP=2 float32 against transformers float32


def _ids(reference: Reference, text: str = PROMPT) -> list[int]:
    return reference.completion_ids(text)


@torch.inference_mode()
def _hf_logprobs(reference: Reference, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `tokens` [len, V]."""
    model = hf_model(str(reference.checkpoint))
    return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def _metric(server: Server, name: str) -> float:
    return parse_metrics(server.metrics()).value(name)


# ---- log-probabilities ---------------------------------------------------------------


def test_completion_logprobs_equal_transformers(server: Server, reference: Reference) -> None:
    ids = _ids(reference)
    r = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                           temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    want = reference.greedy(tuple(ids), 8)
    out = list(want.tokens)
    assert len(lp.tokens) == len(out) == r.usage.completion_tokens
    ref = _hf_logprobs(reference, ids + out)
    for i, token in enumerate(out):
        row = ref[len(ids) + i - 1]
        assert lp.token_logprobs[i] == pytest.approx(row[token].item(), abs=TOL)
        assert lp.tokens[i] == reference.tok.decode([token])
        top = lp.top_logprobs[i]
        best = row.topk(3)
        assert max(top.values()) == pytest.approx(best.values[0].item(), abs=TOL)
        assert reference.tok.decode([best.indices[0].item()]) in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(out))]


def test_chat_logprobs_with_top_logprobs(server: Server, reference: Reference) -> None:
    messages = [{"role": "user", "content": "Grüße aus München"}]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                temperature=0, logprobs=True, top_logprobs=4)
    ids = reference.chat_ids(messages)
    out = list(reference.greedy(tuple(ids), 6).tokens)
    content = r.choices[0].logprobs.content
    assert len(content) == len(out)
    ref = _hf_logprobs(reference, ids + out)
    for i, entry in enumerate(content):
        row = ref[len(ids) + i - 1]
        assert entry.logprob == pytest.approx(row[out[i]].item(), abs=TOL)
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            row.topk(4).values.tolist(), abs=TOL)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompts_logprobs_first_null(server: Server, reference: Reference,
                                                      max_tokens: int) -> None:
    """What lm-evaluation-harness sends for loglikelihood (max_tokens 1) and what it may."""
    ids = _ids(reference)
    r = server.client().completions.create(model=MODEL, prompt=[ids], max_tokens=max_tokens,
                                           temperature=0, logprobs=1, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _hf_logprobs(reference, ids)
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=TOL)
        # lm-eval's greedy check: is the token's value the best in its top_logprobs?
        greedy = ref[pos - 1].argmax().item() == ids[pos]
        assert (lp.token_logprobs[pos] == max(lp.top_logprobs[pos].values())) == greedy
    assert choice.text.startswith(PROMPT)
    assert r.usage.completion_tokens == max_tokens and r.usage.prompt_tokens == len(ids)
    if max_tokens == 0:
        assert choice.text == PROMPT and choice.finish_reason == "length"


# ---- penalties and logits processors -------------------------------------------------

PROCESSORS = {
    "presence+frequency": dict(presence_penalty=1.2, frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.6),
    "logit_bias": dict(logit_bias={"35": 9.0, "60": -100}),
    "all": dict(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=1.0,
                logit_bias={"70": 4.0}),
}


def _params(fields: dict, **kw: object) -> SamplingParams:
    bias = tuple((int(k), float(v)) for k, v in fields.get("logit_bias", {}).items())
    return SamplingParams(**{**{k: v for k, v in fields.items() if k != "logit_bias"},
                             "logit_bias": bias, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_greedy_processors_equal_transformers_generate(server: Server, reference: Reference,
                                                       name: str) -> None:
    fields = PROCESSORS[name]
    ids = _ids(reference)
    extra = {"ignore_eos": True, **{k: v for k, v in fields.items()
                                     if k == "repetition_penalty"}}
    std = {k: v for k, v in fields.items() if k != "repetition_penalty"}
    r = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=12,
                                           temperature=0, extra_body=extra,
                                           **std)  # type: ignore[arg-type]
    params = _params(fields, max_tokens=12, temperature=0)
    with torch.inference_mode():
        ref = hf_model(str(reference.checkpoint)).generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
            logits_processor=hf_processors(params, len(ids)))
    want = ref[0, len(ids):].tolist()
    assert r.choices[0].text == reference.tok.decode(want, skip_special_tokens=True)


def test_min_tokens_and_stop_token_ids(server: Server, reference: Reference) -> None:
    ids = _ids(reference)
    out = list(reference.greedy(tuple(ids), 10, ignore_eos=True).tokens)
    stop = out[2]  # greedy would stop after 3 tokens on this id...
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": [stop], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == out.index(stop) + 1
    # ...but not before min_tokens: transformers with MinNewTokensLength says what comes.
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": [stop], "ignore_eos": True,
                                              "min_tokens": 6})
    params = SamplingParams(max_tokens=10, temperature=0, min_tokens=6, stop_token_ids=(stop,))
    with torch.inference_mode():
        ref = hf_model(str(reference.checkpoint)).generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=10, do_sample=False, eos_token_id=stop, pad_token_id=0,
            logits_processor=hf_processors(params, len(ids)))
    want = ref[0, len(ids):].tolist()
    assert r.usage.completion_tokens == len(want) >= 6
    assert r.choices[0].text == reference.tok.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["presence+frequency", "all"])
def test_seeded_draws_replay_from_transformers(server: Server, reference: Reference,
                                               name: str) -> None:
    fields = PROCESSORS[name]
    ids = _ids(reference)
    extra = {"ignore_eos": True, **{k: v for k, v in fields.items()
                                     if k == "repetition_penalty"}}
    std = {k: v for k, v in fields.items() if k != "repetition_penalty"}
    r = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=10,
                                           temperature=0.9, top_p=0.95, seed=2024,
                                           logprobs=0, extra_body=extra,
                                           **std)  # type: ignore[arg-type]
    lp = r.choices[0].logprobs
    # The token ids: re-encode each token's text piece by piece is lossy; the ids come
    # from replaying instead, checked against the texts the server sent.
    params = _params(fields, max_tokens=10, temperature=0.9, seed=2024)
    gen = torch.Generator().manual_seed(2024)
    out: list[int] = []
    for i in range(10):
        scaled = hf_steps(reference.checkpoint, ids, out + [0], params)[-1]
        probs = scaled.softmax(-1)
        # top_p 0.95 (documented order: processors, temperature, top-k/top-p, draw)
        order = probs.argsort(descending=True, stable=True)
        mass = probs[order].cumsum(0) - probs[order]
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[mass < 0.95]] = True
        token = _replay(probs * keep, torch.rand((), generator=gen).item())
        assert lp.tokens[i] == reference.tok.decode([token]), f"step {i}"
        assert lp.token_logprobs[i] == pytest.approx(scaled.log_softmax(-1)[token].item(),
                                                     abs=TOL)
        out.append(token)


def test_seed_reproducible_across_runs_and_batch_neighbours(server: Server) -> None:
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=99,
                frequency_penalty=0.5)
    alone = server.client().completions.create(**body).choices[0].text  # type: ignore[arg-type]

    async def crowd() -> str:
        client = server.async_client()
        others = [client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=12,
                                            temperature=0.8, seed=i) for i in range(5)]
        res = await asyncio.gather(client.completions.create(**body), *others)
        return res[0].choices[0].text

    assert asyncio.run(crowd()) == alone
    assert server.client().completions.create(**body).choices[0].text == alone


# ---- n > 1 and best_of ---------------------------------------------------------------


def test_n_shares_one_prefill_and_each_choice_is_seed_plus_index(server: Server,
                                                                 reference: Reference) -> None:
    ids = _ids(reference, PROMPT + " and then some more words to make it longer")
    client = server.client()
    before = {k: _metric(server, f"llmserve_{k}_total")
              for k in ("prompt_tokens_computed", "forked_sequences", "kv_blocks_copied")}
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=1.0,
                                  seed=5, n=4, extra_body={"ignore_eos": True})
    after = {k: _metric(server, f"llmserve_{k}_total") for k in before}
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    # The prompt went through the model once, not four times (less what the prefix cache
    # already held from earlier requests); three sequences forked from it.
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(ids) - cached
    assert after["forked_sequences"] - before["forked_sequences"] == 3
    assert after["kv_blocks_copied"] - before["kv_blocks_copied"] == (
        3 if len(ids) % 16 else 0)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 32
    for c in r.choices:
        single = client.completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                           temperature=1.0, seed=5 + c.index,
                                           extra_body={"ignore_eos": True})
        assert c.text == single.choices[0].text, c.index


def test_chat_n_streams_every_choice(server: Server) -> None:
    body = dict(model=MODEL, messages=[{"role": "user", "content": "The lazy dog?"}],
                max_tokens=6, temperature=0.7, seed=11, n=3)
    client = server.client()
    whole = client.chat.completions.create(**body)  # type: ignore[arg-type]
    texts = {i: "" for i in range(3)}
    finish = {}
    for chunk in client.chat.completions.create(**body, stream=True):  # type: ignore[arg-type]
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}


def test_best_of_returns_the_most_likely(server: Server) -> None:
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2,
                                           best_of=5, temperature=1.0, seed=3, logprobs=0,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1]
    assert r.usage.completion_tokens == 30  # every generated sequence is computed


def test_a_batch_of_prompts_with_n(server: Server, reference: Reference) -> None:
    prompts = ["The quick brown fox", "Héllo wörld, ça va?"]
    r = server.client().completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                           temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text == reference.completion(prompts[c.index // 2], 5).text
    # A stop string ends one prompt's choices early; the other prompt runs on unharmed.
    texts = [reference.completion(p, 12, ignore_eos=True).text for p in prompts]
    stop = texts[0][3:5]
    if stop and stop not in texts[1]:
        r = server.client().completions.create(model=MODEL, prompt=prompts, max_tokens=12,
                                               temperature=0, stop=[stop],
                                               extra_body={"ignore_eos": True})
        got = {c.index: c.text for c in r.choices}
        assert got == {0: texts[0][:texts[0].index(stop)], 1: texts[1]}


# ---- structured output ---------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["colour", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3, "items": {
        "type": "string", "pattern": "^[a-z]{1,4}$"}}, "score": {"type": "integer",
                                                              "minimum": 0, "maximum": 100}},
     "required": ["tags", "score"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "enum", "array", "nested"])
@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_output_validates(server: Server, schema: dict, seed: int) -> None:
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me JSON"}], max_tokens=120,
        temperature=1.0, seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_guided_json_regex_and_choice(server: Server, reference: Reference) -> None:
    client = server.client()
    quote, brace = (reference.tok.convert_tokens_to_ids(c) for c in ('"', "}"))
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=150,
        temperature=0.8, seed=4, response_format={"type": "json_object"},
        # A random model ends an unconstrained string only when it draws '"': help it.
        logit_bias={str(quote): 6, str(brace): 6})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=60, temperature=1.0,
                                  seed=2, extra_body={"guided_json": SCHEMAS[1]})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[1])
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=30,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=30, n=3, seed=8,
                                  temperature=1.0,
                                  extra_body={"guided_choice": ["oui", "non", "peut-être"]})
    assert {c.text for c in r.choices} <= {"oui", "non", "peut-être"}


@pytest.mark.parametrize(("field", "value"), [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": {"type": "nope"}}}),
    ("guided_regex", "(unclosed"),
    ("guided_grammar", "root ::= "),
])
def test_a_bad_schema_is_a_400_naming_the_field(server: Server, field: str, value: object
                                                ) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=4,
                                           extra_body={field: value})
    assert info.value.param == field


# ---- usage ---------------------------------------------------------------------------


def test_usage_in_the_last_stream_chunk_with_cached_tokens(server: Server,
                                                           reference: Reference) -> None:
    prompt = "Héllo wörld, ça va? " * 6
    n_ids = len(_ids(reference, prompt))
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n_ids, 5)
    # The first request left the prompt's full blocks in the prefix cache (16 tokens each,
    # at least one token is always computed): the second reports them as cached.
    assert last.usage.prompt_tokens_details.cached_tokens == (n_ids - 1) // 16 * 16 > 0
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=3,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 3
