"""/tokenize, /detokenize, /v1/responses and --reasoning-parser against the real TP=2
server, through the `openai` client; outputs checked against transformers (greedy).

The shared server answers the endpoints; one more server, started with
`--reasoning-parser qwen3`, shows the option end to end. The tiny model does not think, so
its thinking is forced with a grammar (guided_choice) whose only output is a thinking block
and an answer: the engine then generates `<think>`, `</think>` as several tokens each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import MODEL, Reference
from tests.e2e.harness import Server, launch

THOUGHT = "<think>\nThe capital of France is Paris.\n</think>\n\nParis"


def _root(server: Server) -> openai.OpenAI:
    """A client on the server's root: /tokenize and /detokenize are not under /v1."""
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}", api_key="none",
                         timeout=60)


def test_tokenize_and_detokenize_through_the_openai_client(server: Server,
                                                           reference: Reference) -> None:
    root = _root(server)
    out = root.post("/tokenize", body={"model": MODEL, "prompt": "The sky is",
                                       "return_token_strs": True}, cast_to=object)
    assert out["tokens"] == reference.completion_ids("The sky is")
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    assert len(out["token_strs"]) == out["count"]
    back = root.post("/detokenize", body={"tokens": out["tokens"]}, cast_to=object)
    assert back["prompt"].endswith("The sky is")
    # Messages count exactly what the chat endpoint feeds the model.
    messages = [{"role": "user", "content": "Name a colour."}]
    counted = root.post("/tokenize", body={"messages": messages}, cast_to=object)
    assert counted["tokens"] == reference.chat_ids(messages)
    chat = server.client().chat.completions.create(model=MODEL, messages=messages,
                                                   max_tokens=1)
    assert chat.usage.prompt_tokens == counted["count"]
    with pytest.raises(openai.BadRequestError) as info:
        root.post("/detokenize", body={"tokens": ["a"]}, cast_to=object)
    assert info.value.body["param"] == "tokens"


def test_responses_create_equals_the_chat_answer(server: Server, reference: Reference
                                                 ) -> None:
    client = server.client()
    r = client.responses.create(model=MODEL, input="Name a colour.",
                                instructions="Answer in one word.", max_output_tokens=12,
                                temperature=0.0)
    want = reference.chat([{"role": "system", "content": "Answer in one word."},
                           {"role": "user", "content": "Name a colour."}], 12)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == want.text
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert r.usage.input_tokens == want.prompt_tokens
    assert r.instructions == "Answer in one word." and r.max_output_tokens == 12
    # A list of items, earlier turns included, is the same conversation.
    items = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0.0,
                                    input=[{"role": "system", "content": "Answer in one word."},
                                           {"role": "user", "content": [
                                               {"type": "input_text",
                                                "text": "Name a colour."}]}])
    assert items.output_text == want.text


def test_responses_stream_events(server: Server, reference: Reference) -> None:
    client = server.client()
    want = reference.chat([{"role": "user", "content": "Count to three."}], 10)
    events = list(client.responses.create(model=MODEL, input="Count to three.",
                                          max_output_tokens=10, temperature=0.0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.incomplete" if want.finish_reason == "length"
                          else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want.text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == len(want.tokens)


def test_responses_stream_helper_and_structured_text(server: Server) -> None:
    """client.responses.stream assembles the events; a JSON schema makes the output end
    (status completed) however the random tiny model would go on."""
    fmt = {"type": "json_schema", "name": "city",
           "schema": {"type": "string", "enum": ["Paris", "Lyon"]}}
    with server.client().responses.stream(model=MODEL, input="A city?", text={"format": fmt},
                                          max_output_tokens=20) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text in ('"Paris"', '"Lyon"') and "".join(deltas) == final.output_text


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),  # past the context
])
def test_responses_refusals_are_400s_naming_the_field(server: Server, fields: dict,
                                                      param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().responses.create(model=MODEL, input="hi", **fields)
    if param is not None:
        assert info.value.body["param"] == param, info.value.body


# ---- --reasoning-parser ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[Server]:
    srv = launch(engine_dir, tmp_path_factory.mktemp("thinking"),
                 args=("--reasoning-parser", "qwen3", "--warmup", "none"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


def test_reasoning_parser_splits_thinking_from_the_answer(thinking_server: Server,
                                                          reference: Reference) -> None:
    client = thinking_server.client()
    messages = [{"role": "user", "content": "Capital of France?"}]
    forced = {"guided_choice": [THOUGHT]}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80,
                                       extra_body=forced)
    message = r.choices[0].message
    assert message.reasoning_content == "The capital of France is Paris."
    assert message.content == "Paris" and r.choices[0].finish_reason == "stop"
    # Streamed: the same split, the markers (several tokens each) in neither field.
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80,
                                                stream=True, extra_body=forced):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == ("The capital of France is Paris.", "Paris")
    # A model that does not think: its answer is all content, as without the option.
    want = reference.chat(messages, 12)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           temperature=0.0)
    assert plain.choices[0].message.content == want.text
    assert plain.choices[0].message.reasoning_content is None
    # The Responses API on the same server: only a message item.
    resp = client.responses.create(model=MODEL, input="Capital of France?",
                                   max_output_tokens=12, temperature=0.0)
    assert [o.type for o in resp.output] == ["message"] and resp.output_text == want.text
