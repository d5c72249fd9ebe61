"""Tool calls shaped into OpenAI chat answers: the whole message, the streamed deltas (id, type
and name first, then arguments), finish reasons, parallel_tool_calls, and the sampling a tool
choice needs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fulcrum.errors import ConfigError, InvalidInput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.structured_spec import StructuredSpec
from fulcrum.llm.tools import tool_plan
from fulcrum.server.openai_tools import ToolAnswer, tool_answer

TOOLS: Any = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]
TWO_CALLS = (
    'Hi.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
)


def _answer(choice: object = "auto", *, parallel: bool | None = None, parser: str = "hermes"):  # type: ignore[no-untyped-def]
    answer = tool_answer(tool_plan(TOOLS, choice, parallel), parser)
    assert answer is not None
    return answer


def _stream(answer: ToolAnswer, pieces: list[str]) -> tuple[list[dict[str, Any]], str | None]:
    stream = answer.stream()
    deltas, reason = [], None
    for i, piece in enumerate(pieces):
        delta, reason = stream.delta(0, piece, "stop" if i == len(pieces) - 1 else None)
        deltas.append(delta)
    return deltas, reason


def test_auto_message_has_calls_content_and_tool_calls_reason() -> None:
    message, reason = _answer().message(TWO_CALLS, "stop")
    assert reason == "tool_calls"
    assert message["content"] == "Hi."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f", "g"]
    assert message["tool_calls"][0]["type"] == "function"
    assert message["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}


def test_a_length_cut_keeps_its_reason() -> None:
    assert _answer().message(TWO_CALLS, "length")[1] == "length"


def test_text_without_calls_is_a_plain_message() -> None:
    assert _answer().message("Just text.", "stop") == (
        {"role": "assistant", "content": "Just text."},
        "stop",
    )


def test_not_parallel_keeps_the_first_call_whole_and_streamed() -> None:
    message, _ = _answer(parallel=False).message(TWO_CALLS, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    deltas, _ = _stream(_answer(parallel=False), list(TWO_CALLS))
    assert {c["index"] for d in deltas for c in d.get("tool_calls", [])} == {0}


def test_streamed_deltas_open_each_call_with_id_type_and_name() -> None:
    deltas, reason = _stream(_answer(), list(TWO_CALLS))
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    firsts = [c for c in calls if "id" in c]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in firsts] == [
        (0, "function", "f"),
        (1, "function", "g"),
    ]
    assert all(set(c) == {"index", "function"} for c in calls if "id" not in c)
    arguments = "".join(c["function"]["arguments"] for c in calls if c["index"] == 0)
    assert json.loads(arguments) == {"a": 1}
    assert "".join(d.get("content", "") for d in deltas) == "Hi."
    assert reason == "tool_calls"


def test_a_named_call_streams_its_arguments_and_keeps_stop() -> None:
    named = _answer({"type": "function", "function": {"name": "f"}})
    deltas, reason = _stream(named, ['{"a"', ": 1}"])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert deltas[1]["tool_calls"] == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert reason == "stop"
    message, _ = named.message('{"a": 1}', "stop")
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "f"


def test_required_reads_the_forced_array() -> None:
    text = '[{"name": "g", "parameters": {}}, {"name": "f", "parameters": {"a": 2}}]'
    message, reason = _answer("required", parser="").message(text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["g", "f"]
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"a": 2}
    assert reason == "tool_calls"


def test_auto_without_a_parser_is_a_400_and_none_reads_nothing() -> None:
    with pytest.raises(InvalidInput) as caught:
        tool_answer(tool_plan(TOOLS, "auto", None), "")
    assert caught.value.param == "tool_choice"
    assert tool_answer(tool_plan(TOOLS, "none", None), "hermes") is None


def test_forced_choices_constrain_sampling_with_the_schema() -> None:
    params = SamplingParams(max_tokens=8)
    forced = _answer("required", parser="").sampling(params)
    assert forced.structured is not None and forced.structured.kind == "json_schema"
    assert json.loads(forced.structured.source)["minItems"] == 1
    assert _answer().sampling(params) is params  # auto: the model writes freely
    assert not _answer(parser="mistral").sampling(params).skip_special_tokens
    constrained = SamplingParams(max_tokens=8, structured=StructuredSpec("json_object", ""))
    with pytest.raises(InvalidInput) as caught:
        _answer("required").sampling(constrained)
    assert caught.value.param == "tool_choice"


def test_the_parser_is_a_checked_model_parameter() -> None:
    assert EngineParams.from_parameters({"tool_call_parser": "hermes"}).tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match="tool_call_parser"):
        EngineParams.from_parameters({"tool_call_parser": "hermes2"})
