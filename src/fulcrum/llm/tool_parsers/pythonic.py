"""Pythonic tool calls: the output is a Python list of calls, `[get_weather(city="Paris"),
now()]` (vLLM's `pythonic`, Llama 3.2 and 4). Arguments must be literals. The list is parsed
once it closes, so each call streams whole: id, name and arguments in one delta."""

from __future__ import annotations

import ast

from fulcrum.llm.tool_parsers.base import Delta, NewId, dumps
from fulcrum.llm.tool_parsers.marked import WHITESPACE


class PythonicParser:
    def __init__(self, new_id: NewId) -> None:
        self._new_id = new_id
        self._buffer = ""  # the list while it is read
        self._state = "start"  # start, list, content
        self._broken = False

    @property
    def well_formed(self) -> bool:
        return not self._broken

    def feed(self, text: str) -> Delta:
        delta = Delta()
        if self._state == "content":
            delta.content = text
            return delta
        self._buffer += text
        if self._state == "start":
            stripped = self._buffer.lstrip(WHITESPACE)
            if not stripped:
                return delta
            if not stripped.startswith("["):
                return self._to_content(delta)
            self._state = "list"
        # The list can only have closed at a "]": parse only then (a parse is O(length)).
        end = self._buffer.rfind("]") if "]" in text else -1
        if end >= 0:
            calls = _calls(self._buffer[: end + 1])
            if calls is not None:
                self._emit(calls, delta)
                rest = self._buffer[end + 1 :]
                self._state, self._buffer = "content", ""
                delta.content = rest.strip(WHITESPACE) and rest
        return delta

    def _emit(self, calls: list[tuple[str, dict[str, object]]], delta: Delta) -> None:
        for index, (name, arguments) in enumerate(calls):
            delta.add_call(index, id=self._new_id(), name=name, arguments=dumps(arguments))

    def _to_content(self, delta: Delta) -> Delta:
        delta.content, self._buffer, self._state = self._buffer, "", "content"
        return delta

    def finish(self) -> Delta:
        delta = Delta()
        if self._state == "list":
            self._broken = True
            return self._to_content(delta)
        if self._state == "start":
            return self._to_content(delta)
        return delta


def _calls(text: str) -> list[tuple[str, dict[str, object]]] | None:
    """The calls of a list of calls with literal keyword arguments; None for anything else."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[tuple[str, dict[str, object]]] = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        arguments: dict[str, object] = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        calls.append((node.func.id, arguments))
    return calls
