"""Hermes / Qwen2.5 tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one call per block, any number of blocks, text around them is content (vLLM's `hermes`). A
block left open by the end of the output counts when its JSON is complete."""

from __future__ import annotations

from fulcrum.llm.tool_parsers.base import Delta, NewId
from fulcrum.llm.tool_parsers.marked import WHITESPACE, MarkedParser

CLOSE = "</tool_call>"


class HermesParser(MarkedParser):
    marker = "<tool_call>"
    argument_keys = ("arguments",)

    def __init__(self, new_id: NewId) -> None:
        super().__init__(new_id)
        self._close = ""  # how much of </tool_call> has been read

    def _section(self, text: str, delta: Delta) -> str:
        i = 0
        while i < len(text):
            if self._state == "pre":  # whitespace, then the call's {
                if text[i] in WHITESPACE:
                    self.note(text[i])
                    i += 1
                    continue
                self.start_call()
                self._state = "object"
            elif self._state == "object":
                i = self.feed_call(text, i, delta)
                if self._raw:
                    return text[i:]
                if self.call_done:
                    self._state, self._close = "post", ""
            else:
                i, rest = self._read_close(text, i)
                if rest is not None:
                    self.end_section()
                    return rest
        return ""

    def _read_close(self, text: str, i: int) -> tuple[int, str | None]:
        """Whitespace, then </tool_call>: (where reading stopped, the text after the block once
        it ended). Anything else ends the block there and is content."""
        ch = text[i]
        if not self._close and ch in WHITESPACE:
            return i + 1, None
        if CLOSE.startswith(self._close + ch):
            self._close += ch
            return i + 1, (text[i + 1 :] if self._close == CLOSE else None)
        return i, self._close + text[i:]

    def complete_at_end(self) -> bool:
        return self._state == "post"
