"""The shared TP=2 server through the real `openai` client: readiness, parity, concurrency.

Every generated text is compared with transformers' greedy output for the same prompt
ids (float32, the tokenizer's eos as eos_token_id), token counts included.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time

import pytest

from serve.gates import GATE_NAMES
from tests.e2e.conftest import MAX_SEQ_LEN, MODEL, Reference, usage_of
from tests.e2e.harness import Server

COMPLETION_PROMPTS = ["The quick brown fox", "Héllo wörld, ça va?", "emoji 🙂 and ✓ marks",
                      "stop here END and more END text"]
CONVERSATIONS = [
    [{"role": "user", "content": "The lazy dog?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Grüße aus München"},
     {"role": "assistant", "content": "ça va"},
     {"role": "user", "content": "the quick brown fox"}],
]
WORDS = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", ".", "Héllo",
         "wörld", ",", "ça", "va", "?", "日本語", "🙂", "✓"]


def _timed(gate: dict) -> bool:
    return (isinstance(gate["start"], float) and isinstance(gate["end"], float)
            and gate["start"] <= gate["end"]
            and abs(gate["seconds"] - (gate["end"] - gate["start"])) < 1e-6)


# ---- start-up ---------------------------------------------------------------------------


def test_ready_is_503_with_every_gate_until_admission_then_200(server: Server) -> None:
    answered = [p for p in server.history if p.ready is not None]
    trace = [(round(p.t, 2), p.live, p.ready) for p in server.history]
    assert answered[-1].ready == 200, trace
    starting = answered[:-1]
    assert starting, f"readiness was never observed before admission: {trace}"
    passed_counts = []
    for p in starting:
        assert p.ready == 503, trace
        assert p.ready_headers["content-type"].startswith("application/json")
        assert int(p.ready_headers["retry-after"]) > 0
        assert p.ready_body["status"] == "starting"
        gates = p.ready_body["gates"]
        assert [g["name"] for g in gates] == list(GATE_NAMES)
        assert gates[-1]["state"] != "passed", "admission passed while ready said 503"
        for g in gates:
            assert g["state"] in ("pending", "running", "passed"), g
            if g["state"] == "passed":
                assert _timed(g), g
            if g["state"] == "running":
                assert isinstance(g["start"], float) and g["end"] is None, g
        passed_counts.append(sum(g["state"] == "passed" for g in gates))
    # The 503 bodies show start-up progressing gate by gate, never going back.
    assert passed_counts == sorted(passed_counts)
    assert len(set(passed_counts)) >= 2, passed_counts
    final = answered[-1].ready_body
    assert final["status"] == "ready"
    assert all(g["state"] == "passed" and _timed(g) for g in final["gates"][:-1]), final


def test_live_answers_200_during_start_up(server: Server) -> None:
    starting = [p for p in server.history if p.ready == 503]
    assert starting
    assert all(p.live == 200 for p in starting), [(p.t, p.live, p.ready) for p in starting]
    assert server.call("GET", "/health/live").status == 200


def test_engine_report_has_every_gate_with_timing_and_the_load_figures(server: Server) -> None:
    rep = server.call("GET", "/v1/engine").json()
    gates = rep["gates"]
    assert [g["name"] for g in gates] == list(GATE_NAMES)
    assert all(g["state"] == "passed" and _timed(g) for g in gates), gates
    for before, after in itertools.pairwise(gates):  # one after the other, in order
        assert after["start"] >= before["end"] - 1e-6, (before, after)
    assert rep["engine"]["model"] == MODEL and rep["engine"]["tp"] == 2
    assert rep["engine"]["profile"]["max_seq_len"] == MAX_SEQ_LEN
    assert rep["world_size"] == 2 and rep["phase"] == "ready"
    assert [r["rank"] for r in rep["load"]] == [0, 1]
    for load in rep["load"]:
        assert load["bytes"] > 0 and load["gbps"] > 0, load
        assert load["floors"]["storage_read_gbps"] > 0 and load["floors"]["host_copy_gbps"] > 0
    assert "rank0.safetensors" in gates[GATE_NAMES.index("verify")]["evidence"]["files"]
    assert rep["kv_cache"]["blocks"] > 0
    # Two unbound ranks on this host: each pins its step thread to its half of the cores.
    host = sorted(os.sched_getaffinity(0))
    assert rep["threads"]["step_thread_cores"] == host[:max(1, len(host) // 2)], rep["threads"]
    # On a CPU, prompts computed while others decode, or in a step that admits a waiting
    # request, come in chunks of at most 128 tokens.
    admission = gates[GATE_NAMES.index("admission")]["evidence"]
    assert admission["max_prefill_tokens_while_decoding"] == 128, admission
    assert admission["max_prefill_tokens_while_waiting"] == 128, admission
    # The collector was held through the gates and the start-up heap frozen at admission
    # (serve/gcpolicy.py); its pauses since are reported by generation.
    assert admission["gc_frozen_objects"] > 50_000, admission
    assert set(rep["gc"]) == {"gen0", "gen1", "gen2"}
    assert all(g["collections"] >= 0 and g["total_ms"] >= g["max_ms"] >= 0
               for g in rep["gc"].values()), rep["gc"]
    # The same timeline is logged at admission as one table, a row per gate.
    log = server.stderr()
    table = log[log.index("admission open; cold start:"):].splitlines()[1:len(GATE_NAMES) + 2]
    assert [row.split()[:2] for row in table] == [["gate", "state"]] + [
        [name, "passed"] for name in GATE_NAMES], table


def test_models_lists_the_engines_model(server: Server) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]


# ---- parity with transformers -----------------------------------------------------------


@pytest.mark.parametrize("prompt", COMPLETION_PROMPTS)
def test_greedy_completion_equals_transformers(server: Server, reference: Reference,
                                               prompt: str) -> None:
    want = reference.completion(prompt, 24)
    got = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                             temperature=0)
    assert got.model == MODEL and got.object == "text_completion"
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert usage_of(got) == (want.prompt_tokens, len(want.tokens))


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "multi-turn"])
def test_chat_completion_through_the_chat_template_equals_transformers(
        server: Server, reference: Reference, messages: list[dict[str, str]]) -> None:
    want = reference.chat(messages, 20)
    assert "<|im_start|>assistant" in reference.tok.decode(reference.chat_ids(messages))
    got = server.client().chat.completions.create(model=MODEL, messages=messages,
                                                  max_completion_tokens=20, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert usage_of(got) == (want.prompt_tokens, len(want.tokens))


def test_streamed_completion_equals_transformers(server: Server, reference: Reference) -> None:
    prompt = COMPLETION_PROMPTS[1]
    want = reference.completion(prompt, 40)
    stream = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert len(texts) > 2, "the answer should arrive in several chunks"
    assert "".join(texts) == want.text
    assert finishes[-1] == want.finish_reason and not any(finishes[:-1])
    assert not chunks[-1].choices and usage_of(chunks[-1]) == (want.prompt_tokens, len(want.tokens))
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_equals_transformers(server: Server, reference: Reference) -> None:
    messages = CONVERSATIONS[0]
    want = reference.chat(messages, 30)
    stream = server.client().chat.completions.create(model=MODEL, messages=messages,
                                                     max_tokens=30, temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_sse_stream_ends_with_done(server: Server) -> None:
    reply = server.call("POST", "/v1/completions", {"model": MODEL, "prompt": "The quick",
                                                    "max_tokens": 5, "stream": True})
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = [e for e in reply.body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_the_greedy_text(server: Server, reference: Reference) -> None:
    prompt = COMPLETION_PROMPTS[0]
    full = reference.completion(prompt, 24).text
    # A stop string the greedy text contains (past its start, no replacement character).
    at = next(i for i in range(1, len(full) - 2) if "\ufffd" not in full[i:i + 3])
    stop = full[at:at + 3]
    got = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                             temperature=0, stop=[stop])
    assert got.choices[0].text == full[:full.index(stop)]
    assert got.choices[0].finish_reason == "stop"


# ---- in-flight batching -----------------------------------------------------------------


def test_16_concurrent_streams_each_equal_their_serial_greedy_run(
        server: Server, reference: Reference) -> None:
    jobs = [(" ".join(WORDS[i % 7: i % 7 + 1 + (3 * i) % 11]), 10 + 3 * i) for i in range(16)]
    wants = [reference.completion(p, n) for p, n in jobs]
    assert len({w.prompt_tokens for w in wants}) > 5 and len({len(w.tokens) for w in wants}) == 16

    async def one(client, prompt: str, n: int) -> tuple[str, str | None, tuple, float, float]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True})
        parts, finish, usage, first = [], None, None, None
        async for chunk in stream:
            first = first or time.monotonic()
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = usage_of(chunk)
        return "".join(parts), finish, usage, first, time.monotonic()

    async def all_of_them() -> list:
        client = server.async_client()
        try:
            return await asyncio.gather(*(one(client, p, n) for p, n in jobs))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    for i, ((text, finish, usage, _, _), want) in enumerate(zip(results, wants)):
        assert (text, finish) == (want.text, want.finish_reason), f"request {i}"
        assert usage == (want.prompt_tokens, len(want.tokens)), f"request {i}"
    # They really ran together: some moment had most of them streaming at once.
    spans = [(r[3], r[4]) for r in results]
    overlap = max(sum(s <= t <= e for s, e in spans) for t, _ in spans)
    assert overlap >= 8, spans
