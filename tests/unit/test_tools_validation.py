"""A request's tools checked with 400s naming the param, and the schemas that force calls for
tool_choice "required" and a named function (vLLM's)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fulcrum.errors import InvalidInput
from fulcrum.llm.tools import MAX_TOOLS, tool_plan

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city"],
    "$defs": {"unit": {"enum": ["C", "F"]}},
}


def _tool(name: str, parameters: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [_tool("get_weather", WEATHER, description="Weather."), _tool("now")]


def _param(tools: object, choice: object = None, parallel: bool | None = None) -> str | None:
    with pytest.raises(InvalidInput) as caught:
        tool_plan(tools, choice, parallel)
    return caught.value.param


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([], "tools"),
        ("get_weather", "tools"),
        ([_tool("f")] * 2, "tools[1].function.name"),
        ([_tool("f"), _tool("f", {})], "tools[1].function.name"),
        ([_tool("has space")], "tools[0].function.name"),
        ([_tool("x" * 65)], "tools[0].function.name"),
        ([_tool("")], "tools[0].function.name"),
        ([{"type": "function", "function": {}}], "tools[0].function.name"),
        ([{"type": "code_interpreter"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        (["f"], "tools[0]"),
        (
            [_tool("f", {"type": "object"}), _tool("g", parameters="{}")],
            "tools[1].function.parameters",
        ),  # type: ignore[arg-type]
        ([_tool("f", description=3)], "tools[0].function.description"),
        ([_tool("f", strict="yes")], "tools[0].function.strict"),
        ([_tool(f"f{i}") for i in range(MAX_TOOLS + 1)], "tools"),
        ([_tool("f", {"description": "x" * 300_000})], "tools"),
    ],
)
def test_each_bad_tool_is_a_400_naming_its_param(tools: object, param: str) -> None:
    assert _param(tools) == param


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ("sometimes", "tool_choice"),
        ({"type": "function"}, "tool_choice"),
        ({"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name"),
        ({"type": "other", "function": {"name": "now"}}, "tool_choice"),
    ],
)
def test_a_bad_tool_choice_is_a_400_naming_it(choice: object, param: str) -> None:
    assert _param(TOOLS, choice) == param


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_tool_choice_other_than_none_needs_tools(choice: str) -> None:
    assert _param(None, choice) == "tool_choice"
    assert tool_plan(None, "none", None).mode == "none"


def test_defaults_follow_openai() -> None:
    assert tool_plan(TOOLS, None, None).mode == "auto"
    assert tool_plan(None, None, None).mode == "none"
    assert tool_plan(None, None, None).template_tools is None
    assert tool_plan(TOOLS, None, None).parallel
    assert not tool_plan(TOOLS, None, False).parallel


def test_template_tools_are_the_definitions_as_sent() -> None:
    assert tool_plan(TOOLS, "none", None).template_tools == TOOLS


def test_named_choice_forces_the_functions_parameters() -> None:
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert (plan.mode, plan.named, plan.is_forced) == ("named", "get_weather", True)
    assert json.loads(plan.forced_schema()) == WEATHER
    now = tool_plan(TOOLS, {"type": "function", "function": {"name": "now"}}, None)
    assert json.loads(now.forced_schema()) == {"type": "object", "properties": {}}


def test_required_forces_a_non_empty_array_of_named_calls() -> None:
    schema = json.loads(tool_plan(TOOLS, "required", None).forced_schema())
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["required"] == ["name", "parameters"]
    assert "$defs" not in first["properties"]["parameters"]  # moved to the root, where $ref points
    assert schema["$defs"] == WEATHER["$defs"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}


def test_required_schema_accepts_valid_calls_and_rejects_others() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(tool_plan(TOOLS, "required", None).forced_schema())
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}},
                         {"name": "now", "parameters": {}}], schema)  # fmt: skip
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather",
                "parameters": {"unit": "K", "city": "x"}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_not_parallel_required_allows_one_call() -> None:
    schema = json.loads(tool_plan(TOOLS, "required", False).forced_schema())
    assert schema["maxItems"] == 1


def test_conflicting_defs_are_a_400() -> None:
    other = {**WEATHER, "$defs": {"unit": {"enum": ["K"]}}}
    plan = tool_plan([_tool("a", WEATHER), _tool("b", other)], "required", None)
    with pytest.raises(InvalidInput) as caught:
        plan.forced_schema()
    assert caught.value.param == "tools"
