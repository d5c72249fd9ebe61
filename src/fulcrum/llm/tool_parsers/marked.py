"""The shared machinery of the JSON tool-call formats: calls tracked as they stream (id and name
first, then arguments), and the parser of formats whose calls follow a marker in free text
(hermes' `<tool_call>`, mistral's `[TOOL_CALLS]`); a subclass reads what follows the marker."""

from __future__ import annotations

from typing import ClassVar

from fulcrum.llm.tool_parsers.base import Delta, HeldText, NewId
from fulcrum.llm.tool_parsers.call_object import CallObject

WHITESPACE = " \t\r\n"


class CallTracker:
    """The call being written and what of it went out. Once the format breaks, the text is
    content from there on: a call whose name was sent cannot be taken back, one whose name was
    not is sent as the text it was (all of the output, spacing too, when it was the first)."""

    def __init__(self, new_id: NewId, argument_keys: tuple[str, ...]) -> None:
        self._new_id = new_id
        self._argument_keys = argument_keys
        self.call: CallObject | None = None
        self.num_calls = 0  # calls whose name went out
        self.header_sent = False
        self.section: list[str] = []  # the text since the current call's section began
        self.broken = False
        self._breaking = ""

    def start(self) -> CallObject:
        self.call = CallObject(self._argument_keys)
        self.header_sent = False
        return self.call

    def feed(self, text: str, start: int, delta: Delta) -> int:
        """Feed the current call; returns where it stopped (its end, or the end of text)."""
        call = self.call
        assert call is not None  # start() precedes feed()
        end = call.feed(text, start)
        self.section.append(text[start:end])
        if call.broken:
            self.broken = True
            self._breaking = text[end - 1 : end]  # content from there on, when the name went out
            return end
        # The name goes out once the arguments have begun as an object (or the call closed), so
        # a call whose arguments are not an object falls back to content whole.
        ready = call.has_arguments or call.done
        if call.name is not None and ready and not self.header_sent:
            delta.add_call(self.num_calls, id=self._new_id(), name=call.name)
            self.header_sent = True
        if self.header_sent:
            fragment = call.take_arguments()
            if call.done and not call.has_arguments:
                fragment = "{}"  # a call without arguments takes none (OpenAI's "{}")
            if fragment:
                delta.add_call(self.num_calls, arguments=fragment)
        if call.done:
            self.num_calls += 1
            self.call = None
            self.header_sent = False
            self.section = []
        return end

    def fallback(self, dropped: str) -> str:
        """The content the broken section becomes."""
        self.broken = True
        if self.header_sent:
            return self._breaking
        text = "".join(self.section)
        return dropped + text if self.num_calls == 0 else text


class MarkedParser:
    """Content until `marker`, then the subclass's section, then content again."""

    marker: ClassVar[str]
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    first_state: ClassVar[str] = "pre"  # where each section's reading starts

    def __init__(self, new_id: NewId) -> None:
        self._held = HeldText(self.marker)
        self._calls = CallTracker(new_id, self.argument_keys)
        self._in_section = False
        self._raw = False  # the format broke: the rest is content
        self._state = ""

    @property
    def well_formed(self) -> bool:
        return not self._calls.broken

    def feed(self, text: str) -> Delta:
        delta = Delta()
        rest = text
        while rest:
            if self._raw:
                delta.content += rest
                break
            if not self._in_section:
                kept, found = self._held.scan(rest)
                delta.content += kept
                if not found:
                    break
                rest, self._held.pending = self._held.pending, ""
                self._in_section = True
                self._calls.section = [self.marker]
                self._state = self.first_state
            else:
                rest = self._section(rest, delta)
        return delta

    def finish(self) -> Delta:
        delta = Delta()
        if self._in_section and not self._raw and not self.complete_at_end():
            self.break_format(delta)
        if not self._raw:
            delta.content += self._held.flush(after_call=self._calls.num_calls > 0)
        return delta

    def break_format(self, delta: Delta) -> None:
        delta.content += self._calls.fallback(self._held.dropped)
        self._raw = True

    def end_section(self) -> None:
        self._in_section = False

    def feed_call(self, text: str, start: int, delta: Delta) -> int:
        """Feed the current call, falling back to content when it breaks."""
        end = self._calls.feed(text, start, delta)
        if self._calls.broken:
            self.break_format(delta)
        return end

    def start_call(self) -> None:
        self._calls.start()

    def note(self, text: str) -> None:
        """Record section text read outside a call (kept for a fallback)."""
        self._calls.section.append(text)

    @property
    def call_done(self) -> bool:
        return self._calls.call is None

    # What a subclass defines: the section reader and which states may end the output.
    def _section(self, text: str, delta: Delta) -> str:
        """Read section text; returns what follows the section's end ("" while inside)."""
        raise NotImplementedError

    def complete_at_end(self) -> bool:
        raise NotImplementedError
