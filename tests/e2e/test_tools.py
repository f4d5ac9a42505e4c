"""Chat tool calling end to end on the SmolLM2 demo model (whose template knows nothing of
tools: the generic format; and under a Hermes-style `--chat-template` with `--tool-parser
hermes`, for `auto` in a template format), with the real `openai` client and two agent
libraries nobody here wrote (the OpenAI Agents SDK, pydantic-ai). The model is 135M parameters: validity
comes from the grammar, so every call is checked against its tool's schema with jsonschema,
over several seeds at temperature 1."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from demo.model import ensure_demo_model
from tests.conftest import REPO, subprocess_env
from tests.e2e.harness import Server, launch

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a timezone",
    "parameters": {"type": "object", "properties": {
        "utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["utc_offset"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def smollm2_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model as an eager float32 engine at TP=1: no compile step (seconds)."""
    store = tmp_path_factory.mktemp("tools-store")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "build", str(ensure_demo_model()), "--tp", "1",
         "--backend", "eager", "--dtype", "float32", "--max-seq-len", "2048",
         "--store", str(store)],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tools_server(smollm2_engine: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Server]:
    srv = launch(smollm2_engine, tmp_path_factory.mktemp("tools-server"), n=1)
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.close()


def _valid_calls(calls: list) -> list[tuple[str, dict]]:
    """Every call has an id, a declared name and arguments valid under its schema."""
    out = []
    assert calls, "no tool calls"
    for call in calls:
        assert call.id and call.type == "function"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    assert len({c.id for c in calls}) == len(calls)
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_named_tool_choice_calls_that_function_with_valid_arguments(tools_server: Server,
                                                                    seed: int) -> None:
    out = tools_server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=120, seed=seed,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert [name for name, _ in _valid_calls(choice.message.tool_calls)] == ["get_time"]


@pytest.mark.parametrize("seed", SEEDS)
def test_required_tool_choice_always_calls(tools_server: Server, seed: int) -> None:
    out = tools_server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(_valid_calls(choice.message.tool_calls)) == 1  # parallel_tool_calls false


@pytest.mark.parametrize("seed", SEEDS)
def test_auto_answers_or_calls_validly(tools_server: Server, seed: int) -> None:
    out = tools_server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=120, seed=seed)
    choice = out.choices[0]
    if choice.finish_reason == "tool_calls":
        _valid_calls(choice.message.tool_calls)
    else:  # a message: the generic format's JSON is unwrapped into plain content
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str) and not choice.message.tool_calls
        assert not choice.message.content.startswith('{"response"')


def test_a_streamed_call_is_assembled_by_the_client(tools_server: Server) -> None:
    client = tools_server.client()
    kwargs = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 120,
              "temperature": 0, "tool_choice": "required", "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kwargs)
    chunks = 0
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            chunks += 1
        final = stream.get_final_completion()
    assert chunks > 3  # streamed in pieces, not one block
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _valid_calls(choice.message.tool_calls) == _valid_calls(
        whole.choices[0].message.tool_calls)


def test_a_round_trip_with_a_tool_result(tools_server: Server) -> None:
    client = tools_server.client()
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=120, temperature=0,
        tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    result = "Sunny, 21 degrees celsius, light wind from the west."
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                            max_tokens=80, temperature=0)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason == "tool_calls":
        _valid_calls(choice.message.tool_calls)
    else:
        assert choice.message.content
    # The call and its result are in the prompt.
    grown = second.usage.prompt_tokens - first.usage.prompt_tokens
    assert grown >= len(result.split()) + 5, grown


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_400s_naming_the_field(tools_server: Server, extra: dict,
                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        tools_server.client().chat.completions.create(model=MODEL, messages=ASK,
                                                      max_tokens=8, **extra)
    assert info.value.body["param"] == param, info.value.body


# ---- auto in a template format (hermes): free text, then every call constrained -------------

# A Hermes-style template for SmolLM2 (ChatML): the tools in a system message, calls as
# <tool_call> JSON, results as <tool_response> user turns (as Qwen 2.5's template does).
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call one or more functions to assist with the user query. The functions, \
in <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a JSON object with the function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role != 'system' %}<|im_start|>system
You are a helpful AI assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not tools %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _shot(city: str, k: int) -> list[dict]:
    args = json.dumps({"city": city, "unit": "celsius"})
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{k}", "type": "function",
                "function": {"name": "get_weather", "arguments": args}}]}]


# Earlier turns that called the tool: a 135M model then starts a call of its own.
FEW_SHOT = [*_shot("Berlin", 1), *_shot("Rome", 2), *_shot("Madrid", 3),
            {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def hermes_server(smollm2_engine: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("hermes-server")
    template = work / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    srv = launch(smollm2_engine, work, n=1,
                 args=("--tool-parser", "hermes", "--chat-template", str(template)))
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.close()


def test_hermes_auto_calls_validly_once_started_and_leaves_text_free(hermes_server: Server
                                                                     ) -> None:
    client = hermes_server.client()
    calls = 0
    for seed, temperature in ((0, 0.0), *((s, 1.0) for s in SEEDS)):  # greedy, sampled
        out = client.chat.completions.create(
            model=MODEL, messages=FEW_SHOT, tools=[WEATHER, TIME], max_tokens=120, seed=seed,
            temperature=temperature)
        choice = out.choices[0]
        if choice.message.tool_calls:  # whatever the model began, it parsed and validates
            assert choice.finish_reason == "tool_calls"
            _valid_calls(choice.message.tool_calls)
            calls += 1
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert calls >= 1, "the model never started a call"
    # A plain question: free text, not forced into a call (greedy: the same answer each run).
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello in French."}],
        tools=[WEATHER], max_tokens=24, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content and "<tool_call>" not in choice.message.content


def test_a_streamed_hermes_auto_call_is_assembled_by_the_client(hermes_server: Server) -> None:
    client = hermes_server.client()
    kwargs = {"model": MODEL, "messages": FEW_SHOT, "tools": [WEATHER], "max_tokens": 120,
              "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    assert _valid_calls(final.choices[0].message.tool_calls) == _valid_calls(
        whole.choices[0].message.tool_calls)


# ---- agent libraries -----------------------------------------------------------------------

def test_openai_agents_sdk_runs_a_function_tool(tools_server: Server) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city.

        Args:
            city: the city's name.
            unit: celsius or fahrenheit.
        """
        seen.append((city, unit))
        return f"sunny in {city}"

    model = agents.OpenAIChatCompletionsModel(model=MODEL,
                                              openai_client=tools_server.async_client())
    agent = agents.Agent(name="weather", instructions="Answer weather questions.",
                         tools=[get_weather], model=model,
                         # Greedy: a sampled draw may spend max_tokens inside a string
                         # argument (the schema bounds none), and the run would then
                         # depend on the draw.
                         model_settings=agents.ModelSettings(tool_choice="required",
                                                             max_tokens=200, temperature=0),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=2))
    assert len(seen) == 1 and isinstance(seen[0][0], str)
    assert result.final_output == f"sunny in {seen[0][0]}"


def test_pydantic_ai_extracts_a_typed_object(tools_server: Server) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population: int = Field(ge=0, le=10**10)  # bounded: else greedy digits run on

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(
        openai_client=tools_server.async_client()))
    agent = Agent(model, output_type=City, retries=0)
    result = agent.run_sync("Paris is the capital of France; 2.1 million people live there.",
                            model_settings={"max_tokens": 200, "temperature": 0,
                                            "parallel_tool_calls": False})
    assert isinstance(result.output, City)  # validated by pydantic: no retry was allowed
