"""Llama 3.1 / 3.2 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`,
several joined by `; `, optionally after `<|python_tag|>` (vLLM's `llama3_json`). Output that
does not open with a call is content; an object without a name is an answer, not a call."""

from __future__ import annotations

from fulcrum.llm.tool_parsers.base import Delta, NewId
from fulcrum.llm.tool_parsers.marked import WHITESPACE, CallTracker

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    def __init__(self, new_id: NewId) -> None:
        self._calls = CallTracker(new_id, ("parameters", "arguments"))
        self._state = "start"  # start, object, separator, next, content
        self._head = ""  # what was read before the first call decided the output's kind

    @property
    def well_formed(self) -> bool:
        return not self._calls.broken

    def feed(self, text: str) -> Delta:
        delta = Delta()
        i = 0
        while i < len(text):
            state = self._state
            if state == "content":
                delta.content += text[i:]
                break
            if state == "start":
                i = self._read_start(text, i, delta)
            elif state == "object":
                i = self._calls.feed(text, i, delta)
                if self._calls.broken:
                    self._fall_back(delta)
                elif self._calls.call is None:
                    self._state = "separator"
            else:
                i = self._read_separator(text, i, delta)
        return delta

    def _read_start(self, text: str, i: int, delta: Delta) -> int:
        ch = text[i]
        head = self._head + ch
        stripped = head.lstrip(WHITESPACE)
        if not stripped or PYTHON_TAG.startswith(stripped):
            self._head = head
            return i + 1
        if stripped.startswith(PYTHON_TAG):  # the tag, then the first call
            stripped = stripped[len(PYTHON_TAG) :].lstrip(WHITESPACE)
            if not stripped:
                self._head = head
                return i + 1
        if stripped != "{":
            self._state = "content"
            delta.content += head
            self._head = ""
            return i + 1
        self._calls.start()
        self._calls.section = [head[:-1]]
        self._head = ""
        self._state = "object"
        return i  # the object reads its own {

    def _read_separator(self, text: str, i: int, delta: Delta) -> int:
        ch = text[i]
        if ch in WHITESPACE:
            return i + 1
        if self._state == "separator" and ch == ";":
            self._state = "next"
            return i + 1
        if self._state == "next" and ch == "{":
            self._calls.start()
            self._state = "object"
            return i
        self._calls.section.append(ch)
        self._fall_back(delta)
        return i + 1

    def _fall_back(self, delta: Delta) -> None:
        delta.content += self._calls.fallback("")
        self._state = "content"

    def finish(self) -> Delta:
        delta = Delta()
        if self._state == "start":
            delta.content += self._head  # only whitespace, or a partial tag
        elif self._state == "object":
            self._fall_back(delta)
        return delta
