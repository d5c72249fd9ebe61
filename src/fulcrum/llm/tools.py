"""A chat request's tools (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): checked, with
a 400 naming the param; passed to the chat template as transformers passes them; and, for
`required` or a named function, the JSON schema that forces valid calls (vLLM's schemas)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from fulcrum.errors import InvalidInput

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_BYTES = 256 * 1024  # all tool definitions as JSON; they are rendered into the prompt
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
ToolChoiceMode = Literal["none", "auto", "required", "named"]
_MODES: dict[str, ToolChoiceMode] = {"none": "none", "auto": "auto", "required": "required"}
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Tool:
    """One function tool; `definition` is the tool as the client sent it (for the template)."""

    name: str
    parameters: dict[str, Any] | None
    definition: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request asks of its tools: `mode`, the named function's name, and whether one
    answer may call several (`parallel_tool_calls`)."""

    tools: tuple[Tool, ...]
    mode: ToolChoiceMode
    named: str | None = None
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` for the chat template: each {"type": "function", "function": {...}}."""
        return [t.definition for t in self.tools] or None

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "named")

    def forced_schema(self) -> str:
        """The JSON schema the output must follow: for a named function its parameters (the
        output is the arguments), for `required` a non-empty array of {"name", "parameters"}."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.named)
            return json.dumps(tool.parameters or _EMPTY_PARAMETERS)
        return json.dumps(required_schema(self.tools, parallel=self.parallel))


def required_schema(tools: tuple[Tool, ...], *, parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice="required": an array of at least one call, each naming a
    tool and giving that tool's parameters; each tool's `$defs` move to the root, where their
    `$ref`s point. Not parallel: at most one call."""
    definitions: dict[str, Any] = {}
    choices = []
    for tool in tools:
        parameters = dict(tool.parameters or _EMPTY_PARAMETERS)
        for key, value in parameters.pop("$defs", {}).items():
            if key in definitions and definitions[key] != value:
                raise InvalidInput(
                    f"tools: two tools define $defs.{key} differently; required tool choice "
                    "needs one definition",
                    param="tools",
                )
            definitions[key] = value
        choices.append({
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.name]},
                "parameters": parameters,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def tool_plan(tools: object, tool_choice: object, parallel_tool_calls: bool | None) -> ToolPlan:
    """The request's tools checked; InvalidInput names the param (`tools[2].function.name`)."""
    checked = _tools(tools)
    mode: ToolChoiceMode = "auto" if checked else "none"  # OpenAI's default
    named = None
    if tool_choice is not None:
        mode, named = _tool_choice(tool_choice, checked)
    return ToolPlan(checked, mode, named, parallel_tool_calls is not False)


def _tools(tools: object) -> tuple[Tool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list) or not tools:
        raise InvalidInput("tools: expected a non-empty list of tools", param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidInput(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    size = len(json.dumps(tools, ensure_ascii=False).encode("utf-8", "replace"))
    if size > MAX_TOOLS_BYTES:
        raise InvalidInput(
            f"tools: the definitions are {size} bytes as JSON; at most {MAX_TOOLS_BYTES}",
            param="tools",
        )
    checked = tuple(_tool(i, tool) for i, tool in enumerate(tools))
    seen: set[str] = set()
    for i, tool in enumerate(checked):
        if tool.name in seen:
            raise InvalidInput(
                f"tools[{i}].function.name: {tool.name!r} is defined twice",
                param=f"tools[{i}].function.name",
            )
        seen.add(tool.name)
    return checked


def _tool(i: int, tool: object) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise InvalidInput(f"{where}: expected an object", param=where)
    if tool.get("type") != "function":
        raise InvalidInput(
            f"{where}.type: only 'function' tools are supported, got {tool.get('type')!r}",
            param=f"{where}.type",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidInput(f"{where}.function: expected an object", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidInput(
            f"{where}.function.name: expected 1 to 64 letters, digits, _ or -, got {name!r}",
            param=f"{where}.function.name",
        )
    _check_type(function, "description", str, f"{where}.function")
    _check_type(function, "strict", bool, f"{where}.function")
    _check_type(function, "parameters", dict, f"{where}.function")
    return Tool(name, function.get("parameters"), tool)


def _check_type(obj: dict[str, Any], key: str, kind: type, where: str) -> None:
    value = obj.get(key)
    if value is not None and not isinstance(value, kind):
        expected = {str: "a string", bool: "a boolean", dict: "a JSON schema object"}[kind]
        raise InvalidInput(f"{where}.{key}: expected {expected}", param=f"{where}.{key}")


def _tool_choice(choice: object, tools: tuple[Tool, ...]) -> tuple[ToolChoiceMode, str | None]:
    if isinstance(choice, str):
        if choice not in _MODES:
            raise InvalidInput(
                f"tool_choice: expected one of {list(_MODES)} or a named function, got {choice!r}",
                param="tool_choice",
            )
        if choice != "none" and not tools:
            raise InvalidInput(f"tool_choice: {choice!r} requires tools", param="tool_choice")
        return _MODES[choice], None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise InvalidInput(
            'tool_choice: expected "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if all(t.name != name for t in tools):
        raise InvalidInput(
            f"tool_choice.function.name: {name!r} is not among the tools",
            param="tool_choice.function.name",
        )
    return "named", str(name)


def template_tool_calls(where: str, tool_calls: object) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` for the chat template, with each call's arguments
    parsed into an object (transformers' templates print them with tojson, as vLLM passes)."""
    if not isinstance(tool_calls, list):
        raise InvalidInput(f"{where}: expected a list", param=where)
    out = []
    for i, call in enumerate(tool_calls):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(function, dict):
            raise InvalidInput(f"{at}: expected {{'type': 'function', 'function': ...}}", param=at)
        if not isinstance(function.get("name"), str):
            where_name = f"{at}.function.name"
            raise InvalidInput(f"{where_name}: expected a string", param=where_name)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise InvalidInput(
                    f"{at}.function.arguments: not valid JSON", param=f"{at}.function.arguments"
                ) from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out
