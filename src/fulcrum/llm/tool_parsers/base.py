"""What a tool-call parser yields: per piece of streamed text a `Delta` (content, and for each
call its id and name first, then argument fragments, as OpenAI streams them), and for a whole
output an `Extracted` answer. One parser object follows one choice of one request."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

NewId = Callable[[], str]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: `arguments` is the JSON object text the model wrote."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class CallDelta:
    """A piece of call `index`: its id and name on its first delta, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Delta:
    """What one piece of model text adds to the answer."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_call(
        self, index: int, *, id: str | None = None, name: str | None = None, arguments: str = ""
    ) -> None:
        """Merge into this delta's entry for `index`, so one delta names each call once."""
        for entry in self.calls:
            if entry.index == index:
                entry.arguments += arguments
                return
        self.calls.append(CallDelta(index, id, name, arguments))

    def extend(self, other: Delta) -> None:
        self.content += other.content
        for entry in other.calls:
            self.add_call(entry.index, id=entry.id, name=entry.name, arguments=entry.arguments)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass(frozen=True, slots=True)
class Extracted:
    """A whole output: the text outside calls (None when calls left none) and the calls."""

    content: str | None
    calls: list[ToolCall]


class StreamParser(Protocol):
    """One choice's parser: `feed` each new piece of text, then `finish` once."""

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...

    @property
    def well_formed(self) -> bool:
        """False once the output broke the family's format (a call that is not valid JSON, a
        call cut off by the end of the output)."""
        ...


def extract(parser: StreamParser, text: str) -> Extracted:
    """The whole output parsed at once; output that breaks the format is all content (vLLM:
    malformed calls are returned as text, never an error)."""
    delta = parser.feed(text)
    delta.extend(parser.finish())
    if not parser.well_formed or not delta.calls:
        return Extracted(text, [])
    calls = [ToolCall(c.id or "", c.name or "", c.arguments) for c in delta.calls]
    return Extracted(delta.content or None, calls)


def dumps(value: object) -> str:
    """JSON as the parsers write arguments they rebuild (not the model's own text)."""
    return json.dumps(value, ensure_ascii=False)


class HeldText:
    """Text outside calls, held back while it might still be the start of a call marker or is
    whitespace: whitespace reaches the client only when text follows it, so the spacing around
    a call is dropped the same way whether the output streams or not."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.pending = ""
        self.dropped = ""  # the whitespace dropped before the latest call marker

    def scan(self, text: str) -> tuple[str, bool]:
        """(content safe to send, whether a marker was found). With a marker, `pending` holds
        what followed it."""
        buf = self.pending + text
        at = buf.find(self.marker)
        if at >= 0:
            before = buf[:at]
            kept = before.rstrip()
            self.dropped = before[len(kept) :]
            self.pending = buf[at + len(self.marker) :]
            return kept, True
        hold = _partial_marker(buf, self.marker)
        body = buf[: len(buf) - hold]
        kept = body.rstrip()
        self.pending = buf[len(kept) :]
        return kept, False

    def flush(self, *, after_call: bool) -> str:
        """At the end: held whitespace is dropped when it trails a call, sent otherwise."""
        pending, self.pending = self.pending, ""
        return "" if after_call and not pending.strip() else pending


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
