"""Incremental detokenisation: split UTF-8 characters, stop strings across tokens, hold-back."""

from __future__ import annotations

from fulcrum.llm.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token i is byte i; decoding drops incomplete UTF-8 as U+FFFD, like byte-level BPE."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _feed(detok: IncrementalDetokenizer, text: str) -> list[str]:
    pieces = []
    for byte in text.encode():
        detok.add(byte)
        pieces.append(detok.take(final=False))
    return pieces


def test_multibyte_characters_appear_only_when_complete() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    pieces = _feed(detok, "aé日")
    assert pieces == ["a", "", "é", "", "", "日"]
    assert detok.text == "aé日"


def test_stop_string_across_tokens_truncates_and_stops() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("END",))
    pieces = _feed(detok, "hello ENDworld")
    assert detok.stopped
    assert detok.text == "hello "
    assert "".join(pieces) + detok.take(final=True) == "hello "


def test_possible_stop_prefix_is_held_back_then_released() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("xyz",))
    pieces = _feed(detok, "abxy")
    assert "".join(pieces) == "ab"  # "xy" may begin "xyz"
    assert not detok.stopped
    assert detok.take(final=True) == "xy"


def test_earliest_of_several_stop_strings_wins() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("cd", "bcd!"))
    _feed(detok, "abcd!")
    assert detok.text == "ab"
