"""One tool call written as a JSON object (`{"name": ..., "arguments": {...}}`), scanned a
character at a time as the model writes it: the name once its string closes, the arguments'
raw text as it arrives, and whether the object broke JSON's rules (hermes, llama3_json and
mistral all write calls this way)."""

from __future__ import annotations

import json

_WHITESPACE = " \t\r\n"
_OPEN = "{["
_CLOSE = "}]"


class CallObject:
    """Scans one call object; `feed` consumes characters up to the object's closing brace.
    The arguments are kept as the model wrote them, so a streamed call and the same call parsed
    whole carry the same text; it is checked as a JSON object when it closes."""

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self._argument_keys = argument_keys
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "open"  # open, key, colon, value, comma, scalar (at depth 1)
        self._key: str | None = None
        self._capture: list[str] | None = None  # the depth-1 key or name string being read
        self._capturing = ""  # "key", "name" or "" (a string value to skip)
        self._in_arguments = False
        self._arguments: list[str] = []
        self._arguments_taken = 0
        self.name: str | None = None
        self.has_arguments = False
        self.done = False
        self.broken = False

    def feed(self, text: str, start: int = 0) -> int:
        """Consume text[start:] up to the end of the object; returns where it stopped."""
        i = start
        while i < len(text) and not (self.done or self.broken):
            self._step(text[i])
            i += 1
        return i

    def take_arguments(self) -> str:
        """The argument text written since the last call."""
        fragment = "".join(self._arguments[self._arguments_taken :])
        self._arguments_taken = len(self._arguments)
        return fragment

    @property
    def arguments(self) -> str:
        return "".join(self._arguments)

    def _step(self, ch: str) -> None:
        if self._in_arguments:
            self._arguments.append(ch)
        if self._in_string:
            self._string_char(ch)
        elif self._depth >= 2:
            self._nested_char(ch)
        elif ch not in _WHITESPACE or self._expect == "scalar":
            self._top_char(ch)

    def _string_char(self, ch: str) -> None:
        if self._capture is not None:
            self._capture.append(ch)
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._in_string = False
            if self._depth == 1:
                self._close_top_string()

    def _close_top_string(self) -> None:
        if not self._capturing:  # a string value of some other key: skipped
            self._expect = "comma"
            return
        raw = "".join(self._capture or ())
        self._capture = None
        try:
            value = json.loads(raw)
        except ValueError:
            self.broken = True
            return
        if self._capturing == "key":
            self._key = value
            self._expect = "colon"
        else:
            self.name = value
            self._expect = "comma"
        self._capturing = ""

    def _nested_char(self, ch: str) -> None:
        if ch == '"':
            self._in_string = True
        elif ch in _OPEN:
            self._depth += 1
        elif ch in _CLOSE:
            self._depth -= 1
            if self._depth == 1:  # the depth-1 value closed
                self._in_arguments = False
                self._expect = "comma"

    def _top_char(self, ch: str) -> None:
        expect = self._expect
        if expect == "open":
            if self._expect_char(ch, "{"):
                self._depth = 1
                self._expect = "key"
        elif expect == "key":
            if ch == "}":
                self._close()
            elif self._expect_char(ch, '"'):
                self._open_string("key")
        elif expect == "colon":
            if self._expect_char(ch, ":"):
                self._expect = "value"
        elif expect == "value":
            self._value_char(ch)
        else:  # comma, or scalar (a number or literal running to the next , or })
            self._after_value(ch, expect)

    def _after_value(self, ch: str, expect: str) -> None:
        if ch == ",":
            self._expect = "key"
        elif ch == "}":
            self._close()
        elif expect == "comma":
            self.broken = True

    def _value_char(self, ch: str) -> None:
        key = self._key
        if key == "name":
            if self._expect_char(ch, '"'):
                self._open_string("name")
        elif key in self._argument_keys and not self.has_arguments:
            if self._expect_char(ch, "{"):  # OpenAI's arguments are an object
                self.has_arguments = True
                self._in_arguments = True
                self._arguments.append(ch)
                self._depth = 2
        elif ch == '"':
            self._open_string("")
        elif ch in _OPEN:
            self._depth = 2
        else:
            self._expect = "scalar"  # a number, true, false or null: ends at , or }

    def _open_string(self, what: str) -> None:
        self._in_string = True
        self._capturing = what
        self._capture = [] if what else None
        if self._capture is not None:
            self._capture.append('"')

    def _expect_char(self, ch: str, wanted: str) -> bool:
        if ch != wanted:
            self.broken = True
            return False
        return True

    def _close(self) -> None:
        self._depth = 0
        self.done = True
        named = isinstance(self.name, str) and bool(self.name)
        if not named or (self.has_arguments and not _is_object(self.arguments)):
            self.broken = True


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
