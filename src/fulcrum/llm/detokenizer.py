"""Incremental detokenisation and stop strings: text grows token by token, a multi-byte character
split across tokens is held until complete, and text that could still be the start of a stop
string is held back from the stream until it is known not to be one."""

from __future__ import annotations

from typing import Protocol


class TextDecoder(Protocol):
    """The part of `tokenizers.Tokenizer` used here."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Output text of one sequence; `add` a token, `take` the text that is safe to emit."""

    def __init__(self, tokenizer: TextDecoder, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._holdback_chars = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        # Decoding a window [prefix, read) vs [prefix, end) gives the new text with the context
        # byte-level and SentencePiece decoders need (leading spaces, merged bytes).
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._num_emitted_chars = 0
        self.stopped = False  # a stop string was found; text ends before it

    def add(self, token_id: int) -> None:
        """Append one generated token and look for a stop string in the new text."""
        if self.stopped:
            return
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset :]
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._tokenizer.decode(window)
        # U+FFFD at the end: an incomplete UTF-8 sequence; wait for the next token.
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return
        start = len(self.text)
        self.text += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._check_stop(start)

    def take(self, *, final: bool) -> str:
        """Text not handed out yet; unless final, keeps back what may begin a stop string."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._holdback_chars
        if end <= self._num_emitted_chars:
            return ""
        new_text = self.text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return new_text

    def _check_stop(self, new_text_start: int) -> None:
        if not self._stop:
            return
        # A stop string may straddle old and new text: search from just before the new part.
        search_from = max(0, new_text_start - self._holdback_chars)
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
