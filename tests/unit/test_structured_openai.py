"""The structured-output fields of an OpenAI body as one StructuredSpec: response_format,
vLLM's structured_outputs and guided_* fields, and the 400s for everything else."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fulcrum.errors import InvalidInput
from fulcrum.llm.structured_spec import StructuredSpec
from fulcrum.protocol.openai import ChatCompletionRequest, CompletionRequest, decode_request
from fulcrum.protocol.openai_structured import structured_request
from fulcrum.service_openai import sampling_params

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


def _spec(**fields: Any) -> tuple[StructuredSpec, str] | None:
    found = structured_request(_chat(**fields))
    return None if found is None else (found.spec, found.field)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": None, "guided_json": None}, None),
        (
            {"response_format": {"type": "json_object"}},
            (StructuredSpec("json_object", ""), "response_format"),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            (StructuredSpec("json_schema", json.dumps(SCHEMA)), "response_format"),
        ),
        (
            {"structured_outputs": {"regex": "a+", "disable_fallback": True}},
            (StructuredSpec("regex", "a+"), "structured_outputs"),
        ),
        (
            {"structured_outputs": {"choice": ["a", "b"], "json_object": False}},
            (StructuredSpec("choice", '["a", "b"]'), "structured_outputs"),
        ),
        (
            {"structured_outputs": {"json_object": True}},
            (StructuredSpec("json_object", ""), "structured_outputs"),
        ),
        (
            {"structured_outputs": {"grammar": "start: /x/"}},
            (StructuredSpec("grammar", "start: /x/"), "structured_outputs"),
        ),
        (
            {"guided_json": json.dumps(SCHEMA)},
            (StructuredSpec("json_schema", json.dumps(SCHEMA)), "guided_json"),
        ),
        (
            {"guided_json": SCHEMA, "guided_decoding_backend": "guidance"},
            (StructuredSpec("json_schema", json.dumps(SCHEMA)), "guided_json"),
        ),
        ({"guided_regex": "[0-9]+"}, (StructuredSpec("regex", "[0-9]+"), "guided_regex")),
        ({"guided_choice": ["x"]}, (StructuredSpec("choice", '["x"]'), "guided_choice")),
        (
            {"guided_grammar": 'root ::= "a"'},
            (StructuredSpec("grammar", 'root ::= "a"'), "guided_grammar"),
        ),
    ],
)
def test_each_field_becomes_one_spec(
    fields: dict[str, Any], expected: tuple[StructuredSpec, str] | None
) -> None:
    assert _spec(**fields) == expected


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            ["response_format", "guided_regex"],
        ),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, ["guided_json", "guided_choice"]),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            ["structured_outputs.regex", "structured_outputs.choice"],
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            ["response_format.json_schema.schema"],
        ),
        ({"response_format": {"type": "yaml"}}, ["response_format.type"]),
        ({"guided_json": "{not json"}, ["guided_json"]),
        ({"guided_json": "[1, 2]"}, ["guided_json"]),
        ({"guided_choice": []}, ["guided_choice"]),
        ({"guided_regex": "  "}, ["guided_regex"]),
        ({"guided_decoding_backend": "xgrammar"}, ["guided_decoding_backend"]),
        ({"guided_whitespace_pattern": " *"}, ["guided_whitespace_pattern"]),
        ({"structured_outputs": {"whitespace_pattern": " *"}}, ["structured_outputs"]),
        ({"structured_outputs": {"disable_any_whitespace": False}}, ["structured_outputs"]),
    ],
)
def test_conflicting_or_malformed_fields_are_a_400_naming_them(
    fields: dict[str, Any], named: list[str]
) -> None:
    with pytest.raises(InvalidInput) as caught:
        structured_request(_chat(**fields))
    for name in named:
        assert name in caught.value.message
    param = caught.value.param
    assert param is not None and any(param.startswith(n.split(".")[0]) for n in named)


def test_completions_take_the_same_fields_into_sampling_params() -> None:
    body = {"model": "m", "prompt": "p", "guided_regex": "[a-z]+"}
    request = decode_request(json.dumps(body).encode(), CompletionRequest)
    assert sampling_params(request, 8).structured == StructuredSpec("regex", "[a-z]+")
    chat = _chat(response_format={"type": "json_object"})
    assert sampling_params(chat, 8).structured == StructuredSpec("json_object", "")
    assert sampling_params(_chat(), 8).structured is None
