"""Output forced by structured output (vLLM's named and `required` tool choice): for a named
function the whole output is its arguments; for `required` it is a JSON array of
{"name", "parameters"} objects, read as it streams like mistral's list of calls."""

from __future__ import annotations

from fulcrum.llm.tool_parsers.base import Delta, NewId
from fulcrum.llm.tool_parsers.mistral import MistralParser


class NamedParser:
    """The output is the named function's arguments: one call, its text streamed as is."""

    def __init__(self, name: str, new_id: NewId) -> None:
        self._name = name
        self._new_id = new_id
        self._started = False

    @property
    def well_formed(self) -> bool:
        return True

    def feed(self, text: str) -> Delta:
        delta = Delta()
        if text or self._started:
            self._open(delta)
            if text:
                delta.add_call(0, arguments=text)
        return delta

    def finish(self) -> Delta:
        delta = Delta()
        self._open(delta)  # an empty output still names the call
        return delta

    def _open(self, delta: Delta) -> None:
        if not self._started:
            delta.add_call(0, id=self._new_id(), name=self._name)
            self._started = True


class RequiredParser(MistralParser):
    """The output is the list itself: a section from the first character (no marker)."""

    marker = ""
    argument_keys = ("parameters",)

    def end_section(self) -> None:
        super().end_section()
        self._raw = True  # one list: whatever follows it is text, never a second list
