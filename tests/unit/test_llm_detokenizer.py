"""Incremental detokenisation: split UTF-8 characters, stop strings across tokens, hold-back."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from fulcrum.llm.detokenizer import IncrementalDetokenizer


def _byte_tokenizer() -> Tokenizer:
    """Token i is byte i, with GPT-2's byte-level decoder: incomplete UTF-8 cannot be shown."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


BYTES = _byte_tokenizer()


def _feed(detok: IncrementalDetokenizer, text: str) -> list[str]:
    pieces = []
    for byte in text.encode():
        detok.add(byte)
        pieces.append(detok.take(final=False))
    return pieces


def test_multibyte_characters_appear_only_when_complete() -> None:
    detok = IncrementalDetokenizer(BYTES)
    pieces = _feed(detok, "aé日")
    assert pieces == ["a", "", "é", "", "", "日"]
    assert detok.text == "aé日"


def test_stop_string_across_tokens_truncates_and_stops() -> None:
    detok = IncrementalDetokenizer(BYTES, stop=("END",))
    pieces = _feed(detok, "hello ENDworld")
    assert detok.stopped
    assert detok.text == "hello "
    assert "".join(pieces) + detok.take(final=True) == "hello "


def test_possible_stop_prefix_is_held_back_then_released() -> None:
    detok = IncrementalDetokenizer(BYTES, stop=("xyz",))
    pieces = _feed(detok, "abxy")
    assert "".join(pieces) == "ab"  # "xy" may begin "xyz"
    assert not detok.stopped
    assert detok.take(final=True) == "xy"


def test_earliest_of_several_stop_strings_wins() -> None:
    detok = IncrementalDetokenizer(BYTES, stop=("cd", "bcd!"))
    _feed(detok, "abcd!")
    assert detok.text == "ab"


def _metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE (Llama's): spaces become a marker that decoding turns back, and
    the first piece of the text loses its marker's space."""
    from tokenizers import pre_tokenizers, trainers

    from fulcrum.llm.example_corpus import CORPUS

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tokenizer


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_streamed_text_equals_decoding_everything_at_once(kind: str) -> None:
    from fulcrum.llm.examples import build_tokenizer

    tokenizer = build_tokenizer(["<s>", "</s>"]) if kind == "byte-level" else _metaspace_tokenizer()
    text = (
        "Grüße, 日本語 and emoji 🙂 — spaced  out words\nnew line"
        if kind == "byte-level"
        else "The quick words, spaced  out: leading spaces must survive streaming."
    )
    ids = tokenizer.encode(text).ids
    rng = random.Random(0)
    ids += [rng.randrange(tokenizer.get_vocab_size()) for _ in range(300)]
    detok = IncrementalDetokenizer(tokenizer)
    streamed = []
    for token_id in ids:
        detok.add(token_id)
        streamed.append(detok.take(final=False))
    streamed.append(detok.take(final=True))
    assert detok.text == tokenizer.decode(ids)
    assert "".join(streamed) == detok.text
