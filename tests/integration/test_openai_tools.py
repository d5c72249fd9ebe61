"""Tool calling through the official openai client against tiny random Llamas in process (issue
13, item 4): tools rendered into the chat template, a named function and "required" forced
through structured output, "auto" parsed by the model's configured parser (hermes here, its
output steered by a constraint), streamed too, and the 400s."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fulcrum.llm.examples import build_tiny_llama
from fulcrum.server.app import create_app
from fulcrum.service import Service

TEMPLATE = (Path(__file__).parent.parent / "data" / "chat_templates" / "qwen2_5.jinja").read_text()
CONFIG = """platform = "llm"
[parameters]
num_kv_blocks = 256
block_size = 4
max_model_len = 1024
"""
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather by city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "The time.",
                                      "parameters": {"type": "object", "properties": {},
                                                     "additionalProperties": False}}},
]  # fmt: skip
USER: Any = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_OUTPUT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
# The random model writes exactly this when a constraint leaves it one choice.
STEER: Any = {"structured_outputs": {"choice": [HERMES_OUTPUT]}}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = tmp_path_factory.mktemp("models")
    for name, extra in (("tiny", 'tool_call_parser = "hermes"\n'), ("plain", "")):
        build_tiny_llama(directory, name=name)
        (directory / name / "config.toml").write_text(CONFIG + extra)
        tok_config = directory / name / "1" / "tokenizer_config.json"
        tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                          "chat_template": TEMPLATE}))  # fmt: skip
    return directory


@pytest.fixture
async def http(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)


def _check_weather(arguments: str) -> None:
    """WEATHER, checked by hand (jsonschema is not a dependency)."""
    value = json.loads(arguments)
    assert set(value) == {"city", "days"}, value
    assert value["city"] in ("Paris", "Oslo", "Lima")
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 7


async def test_tools_are_rendered_into_the_prompt(
    http: httpx.AsyncClient, client: openai.AsyncOpenAI
) -> None:
    body = {"model": "tiny", "messages": USER}
    bare = (await http.post("/tokenize", json=body)).json()
    with_tools = (await http.post("/tokenize", json={**body, "tools": TOOLS})).json()
    tokens = {"model": "tiny", "tokens": with_tools["tokens"]}
    prompt = (await http.post("/detokenize", json=tokens)).json()
    assert '"name": "get_weather"' in prompt["prompt"] and "Weather by city." in prompt["prompt"]
    assert "# Tools" in prompt["prompt"] and with_tools["count"] > bare["count"]
    # The chat endpoint renders the same prompt (tool_choice none: tools shown, nothing parsed).
    done = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                                tool_choice="none", max_tokens=2)  # fmt: skip
    assert done.usage is not None and done.usage.prompt_tokens == with_tools["count"]
    assert done.choices[0].message.tool_calls is None


async def test_a_named_function_is_forced_with_valid_arguments(client: openai.AsyncOpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(5):
        done = await client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, temperature=1.0,
            seed=seed, max_tokens=60,
        )  # fmt: skip
        message = done.choices[0].message
        assert message.tool_calls is not None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("chatcmpl-tool-")
        _check_weather(call.function.arguments)
        assert done.choices[0].finish_reason == "stop"  # a named call keeps the reason (vLLM)


async def test_required_gives_at_least_one_valid_call(client: openai.AsyncOpenAI) -> None:
    for seed in range(4):
        done = await client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice="required", temperature=1.0,
            seed=seed, max_tokens=120, parallel_tool_calls=False,
        )  # fmt: skip
        calls = done.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1  # not parallel: exactly one
        assert done.choices[0].finish_reason == "tool_calls"
        for call in calls:
            if call.function.name == "get_weather":
                _check_weather(call.function.arguments)
            else:
                assert call.function.name == "now" and json.loads(call.function.arguments) == {}


async def test_required_works_on_a_model_without_a_parser(client: openai.AsyncOpenAI) -> None:
    done = await client.chat.completions.create(
        model="plain", messages=USER, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=120, parallel_tool_calls=False,  # greedy, the random model never stops
    )  # fmt: skip
    assert done.choices[0].message.tool_calls


async def test_auto_parses_the_models_hermes_calls(client: openai.AsyncOpenAI) -> None:
    done = await client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=200,
        extra_body=STEER,
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert len({c.id for c in calls}) == 2


async def test_auto_without_parallel_calls_keeps_the_first(client: openai.AsyncOpenAI) -> None:
    done = await client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=200, parallel_tool_calls=False,
        extra_body=STEER,
    )  # fmt: skip
    assert [c.function.name for c in done.choices[0].message.tool_calls or []] == ["get_weather"]


async def test_auto_streams_content_then_calls(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=200, stream=True, extra_body=STEER,
    )  # fmt: skip
    content, names, ids, arguments, finish = "", {}, {}, {}, None
    num_argument_chunks = 0
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in ids and call.function is not None
                ids[call.index], names[call.index] = call.id, call.function.name
            else:
                assert call.index in ids  # id and name come first
                num_argument_chunks += 1
            arguments[call.index] = arguments.get(call.index, "") + (
                call.function.arguments if call.function and call.function.arguments else ""
            )
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking."
    assert names == {0: "get_weather", 1: "now"}
    assert json.loads(arguments[0]) == {"city": "Paris", "days": 2}
    assert json.loads(arguments[1]) == {}
    assert num_argument_chunks > 1  # arguments arrive in fragments
    assert finish == "tool_calls"


async def test_streamed_named_call(client: openai.AsyncOpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    stream = await client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=60, seed=1,
        stream=True,
    )  # fmt: skip
    first: Any = None
    arguments = ""
    async for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            first = first or call
            arguments += call.function.arguments or "" if call.function else ""
    assert first is not None and first.id and first.function.name == "get_weather"
    _check_weather(arguments)


async def test_malformed_model_output_is_content_not_an_error(client: openai.AsyncOpenAI) -> None:
    broken = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    done = await client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=100,
        extra_body={"structured_outputs": {"choice": [broken]}},
    )  # fmt: skip
    assert done.choices[0].message.content == broken
    assert done.choices[0].message.tool_calls is None
    assert done.choices[0].finish_reason == "stop"


async def test_an_earlier_call_and_its_result_render(client: openai.AsyncOpenAI) -> None:
    call: Any = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    messages: Any = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]  # fmt: skip
    done = await client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert done.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("model", "kwargs", "param"),
    [
        ("plain", {"tools": TOOLS}, "tool_choice"),  # auto (the default) needs a parser
        ("plain", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ("tiny", {"tool_choice": "required"}, "tool_choice"),
        ("tiny", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                  "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ("tiny", {"tools": [*TOOLS, TOOLS[0]]}, "tools[2].function.name"),
        ("tiny", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ("tiny", {"tools": TOOLS, "tool_choice": "required",
                  "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)  # fmt: skip
async def test_tool_errors_are_400s_naming_the_param(
    client: openai.AsyncOpenAI, model: str, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=model, messages=USER, max_tokens=2, **kwargs)
    assert caught.value.param == param


async def test_each_of_n_streamed_choices_gets_its_own_calls(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=200, stream=True, n=2,
        extra_body=STEER,
    )  # fmt: skip
    names: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function is not None and call.function.name:
                    names[choice.index].append(call.function.name)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert names == {0: ["get_weather", "now"], 1: ["get_weather", "now"]}
    assert finish == {0: "tool_calls", 1: "tool_calls"}
