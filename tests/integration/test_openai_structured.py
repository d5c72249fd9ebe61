"""Structured output through the official openai client against the tiny random GPT-2 (in
process, over httpx.ASGITransport): response_format json_schema / json_object, vLLM's regex,
choice and grammar constraints, streamed and with n > 1, and the 400s (issue 13, item 3)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.llm.structured_spec import MAX_SOURCE_BYTES
from fulcrum.server.app import create_app
from fulcrum.service import Service

TINY_CONFIG = """platform = "llm"
[parameters]
num_kv_blocks = 256
block_size = 4
max_model_len = 256
"""
USER: list[Any] = [{"role": "user", "content": "Give me a record"}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
            "maxItems": 2,
        },
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "record", "schema": SCHEMA, "strict": True},
}
ARITHMETIC = """
start: expr
expr: NUM | NUM OP expr
OP: "+" | "-"
NUM: /[1-9][0-9]?/
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = tmp_path_factory.mktemp("models")
    build_tiny_gpt2(directory, name="tiny")
    (directory / "tiny" / "config.toml").write_text(TINY_CONFIG)
    return directory


@pytest.fixture
async def client(service: Service) -> AsyncIterator[openai.AsyncOpenAI]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)


def _check_record(text: str) -> None:
    """SCHEMA, checked by hand (jsonschema is not a dependency)."""
    value = json.loads(text)
    assert set(value) == {"name", "age", "tags"}, value
    assert value["name"] in ("ada", "bob", "cy")
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
    assert all(re.fullmatch("[a-z]{1,4}", tag) for tag in value["tags"])


async def test_json_schema_output_validates_every_time_at_temperature_one(
    client: openai.AsyncOpenAI,
) -> None:
    for seed in range(6):
        answer = await client.chat.completions.create(
            model="tiny",
            messages=USER,
            temperature=1.0,
            seed=seed,
            max_tokens=80,
            response_format=RESPONSE_FORMAT,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        assert choice.message.content is not None
        _check_record(choice.message.content)


async def test_json_schema_on_completions_and_with_n_three(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(
        model="tiny",
        prompt="Record:",
        temperature=1.0,
        seed=3,
        max_tokens=80,
        n=3,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    assert len(answer.choices) == 3
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        _check_record(choice.text)
    assert len({c.text for c in answer.choices}) > 1  # three matchers, three draws


async def test_json_object_parses(client: openai.AsyncOpenAI) -> None:
    finished = 0
    for seed in range(4):
        answer = await client.chat.completions.create(
            model="tiny",
            messages=USER,
            temperature=0.7,
            seed=seed,
            max_tokens=60,
            response_format={"type": "json_object"},
        )
        choice = answer.choices[0]
        content = choice.message.content or ""
        assert content.startswith("{")
        if choice.finish_reason == "stop":  # a random model may ramble to the length limit
            finished += 1
            assert isinstance(json.loads(content), dict)
    assert finished >= 1


async def test_regex_choice_and_grammar(client: openai.AsyncOpenAI) -> None:
    for seed in range(3):
        common: dict[str, Any] = {
            "model": "tiny",
            "prompt": "Hi",
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 30,
        }
        regex = await client.completions.create(
            **common, extra_body={"guided_regex": "[a-e]{2,6}@(x|y)\\.org"}
        )
        assert re.fullmatch("[a-e]{2,6}@(x|y)\\.org", regex.choices[0].text)
        choice = await client.completions.create(
            **common, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}}
        )
        assert choice.choices[0].text in ("red", "green", "blue")
        grammar = await client.completions.create(
            **common, extra_body={"guided_grammar": ARITHMETIC}
        )
        assert re.fullmatch("[1-9][0-9]?([+-][1-9][0-9]?)*", grammar.choices[0].text)


async def test_gbnf_grammar(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(
        model="tiny",
        prompt="Hi",
        temperature=1.0,
        seed=1,
        max_tokens=10,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    )
    assert answer.choices[0].text in ("yes", "no")
    assert answer.choices[0].finish_reason == "stop"


async def test_streamed_json_schema(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="tiny",
        messages=USER,
        temperature=1.0,
        seed=11,
        max_tokens=80,
        stream=True,
        response_format=RESPONSE_FORMAT,
    )
    parts: list[str] = []
    reasons: list[str] = []
    async for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    assert reasons == ["stop"]
    assert sum(1 for p in parts if p) > 1  # streamed token by token, not in one piece
    _check_record("".join(parts))


async def test_grammar_wins_over_min_tokens_and_allowed_token_ids(
    client: openai.AsyncOpenAI,
) -> None:
    answer = await client.completions.create(
        model="tiny",
        prompt="Hi",
        temperature=1.0,
        seed=0,
        max_tokens=40,
        extra_body={"guided_choice": ["yes", "no"], "min_tokens": 30, "allowed_token_ids": [5, 6]},
    )
    assert answer.choices[0].text in ("yes", "no")
    assert answer.choices[0].finish_reason == "stop"


async def _bad_request(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        await call
    return caught.value


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            "guided_json",
            "Invalid type",
        ),
        ({"guided_json": {"not": {"type": "string"}}}, "guided_json", "Unimplemented keys"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "missing_rule"),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", "grammar"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "guided_regex"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "response_format",
        ),
        ({"guided_regex": "a" * (MAX_SOURCE_BYTES + 1)}, "guided_regex", "at most"),
        (
            {"guided_decoding_backend": "xgrammar", "guided_regex": "a"},
            "guided_decoding_backend",
            "xgrammar",
        ),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ],
)
async def test_bad_constraints_are_a_400_naming_the_field(
    client: openai.AsyncOpenAI, extra: dict[str, Any], param: str, needle: str
) -> None:
    error = await _bad_request(
        client.completions.create(model="tiny", prompt="Hi", max_tokens=4, extra_body=extra)
    )
    assert error.param is not None and error.param.startswith(param), error.param
    assert needle in error.message


async def test_a_bad_schema_in_response_format_is_a_400(client: openai.AsyncOpenAI) -> None:
    bad: Any = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "z"}},
    }
    error = await _bad_request(
        client.chat.completions.create(model="tiny", messages=USER, response_format=bad)
    )
    assert error.param == "response_format"
    assert "invalid json_schema" in error.message
