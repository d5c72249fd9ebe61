"""Incremental detokenisation and stop strings: text grows token by token, a multi-byte character
split across tokens is held until complete (`tokenizers`' DecodeStream, one call per token, as
vLLM does for fast tokenizers), and text that could still be the start of a stop string is held
back from the stream until it is known not to be one. Stop strings are looked for only once
min_tokens tokens were generated, and kept in the text with include_stop_str_in_output (vLLM)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from fulcrum.llm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Output text of one sequence; `add` a token, `take` the text that is safe to emit."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # It keeps the few tokens byte-level and SentencePiece decoders need as context (leading
        # spaces, merged bytes) and answers None while a UTF-8 character is incomplete.
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._holdback_chars = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._num_emitted_chars = 0
        self.stopped = False  # a stop string was found; text ends before it

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, sampling: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer a request's settings ask for."""
        return cls(
            tokenizer,
            sampling.stop,
            skip_special_tokens=sampling.skip_special_tokens,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
            min_tokens=sampling.min_tokens,
        )

    def add(self, token_id: int) -> None:
        """Append one generated token and look for a stop string in the new text."""
        if self.stopped:
            return
        self._num_tokens += 1
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
        # vLLM looks for stop strings only once more than min_tokens tokens were generated.
        if not self._stop or self._num_tokens <= self._min_tokens:
            return
        # A stop string may straddle old and new text: search from just before the new part.
        search_from = max(0, new_text_start - self._holdback_chars)
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            start, stop = min(hits)
            self.text = self.text[: start + len(stop) if self._include_stop else start]
            self.stopped = True
