"""Incremental detokenisation and stop strings: text grows token by token, a multi-byte character
split across tokens is held until complete (`tokenizers`' DecodeStream, one call per token, as
vLLM does for fast tokenizers), and text that could still be the start of a stop string is held
back from the stream until it is known not to be one."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Output text of one sequence; `add` a token, `take` the text that is safe to emit."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        # It keeps the few tokens byte-level and SentencePiece decoders need as context (leading
        # spaces, merged bytes) and answers None while a UTF-8 character is incomplete.
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._holdback_chars = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._num_emitted_chars = 0
        self.stopped = False  # a stop string was found; text ends before it

    def add(self, token_id: int) -> None:
        """Append one generated token and look for a stop string in the new text."""
        if self.stopped:
            return
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return
        start = len(self.text)
        self.text += piece
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
