"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (vLLM's `mistral`,
the JSON-list form of Mistral's v3 tokenizers); text before the marker is content. The marker
is a special token, so the request keeps special tokens in its text. Ids are nine letters and
digits, as Mistral's templates require."""

from __future__ import annotations

import secrets
import string

from fulcrum.llm.tool_parsers.base import Delta
from fulcrum.llm.tool_parsers.marked import WHITESPACE, MarkedParser

_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class MistralParser(MarkedParser):
    marker = "[TOOL_CALLS]"
    argument_keys = ("arguments",)
    _listed = False  # the section's calls are in a [...] list

    def _section(self, text: str, delta: Delta) -> str:
        i = 0
        while i < len(text):
            if self._state == "object":
                i = self.feed_call(text, i, delta)
                if self._raw:
                    return text[i:]
                if self.call_done:
                    self._state = "separator" if self._listed else "end"
                continue
            if self._state == "end":  # one call without the list: the section ends after it
                self.end_section()
                return text[i:]
            ch = text[i]
            if ch == "{" and self._state in ("pre", "item"):
                self._listed = self._state == "item"
                self.start_call()  # the object reads its own {
                self._state = "object"
                continue
            i += 1
            self.note(ch)
            if ch in WHITESPACE:
                continue
            if not self._punctuation(ch):
                self.break_format(delta)
                return text[i:]
            if self._state == "done":
                self.end_section()
                return text[i:]
        return ""

    def _punctuation(self, ch: str) -> bool:
        """The list's [ , ] between calls; False for anything else."""
        state = self._state
        if (state, ch) in (("pre", "["), ("separator", ",")):
            self._state = "item"
        elif state in ("separator", "item") and ch == "]":
            self._state = "done"
        else:
            return False
        return True

    def complete_at_end(self) -> bool:
        # A list the output's end cut after a whole call still holds that call.
        return self._state in ("separator", "end", "done") or (
            self._state == "item" and self._calls.num_calls > 0
        )
