from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from fulcrum.backends.text import MAX_BYTES_PER_TOKEN, TextFrontEnd, cut_text
from fulcrum.config import Tokenizer
from fulcrum.errors import ConfigError, InvalidInput
from fulcrum.examples import minilm_source_dir

CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    shutil.copyfile(minilm_source_dir() / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def front(version_dir: Path) -> TextFrontEnd:
    return TextFrontEnd(Tokenizer(max_length=16), version_dir)


def texts(*rows: str | bytes) -> np.ndarray:
    array = np.empty(len(rows), dtype=object)
    array[:] = rows
    return array


def test_pads_to_the_longest_row_not_the_files_fixed_length(front: TextFrontEnd) -> None:
    out = front.encode(texts(b"hello", b"hello big wide world"))
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.dtype == np.int64 and ids.shape == (2, 6)  # [CLS] 4 words [SEP]; file says 128
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    assert ids[0].tolist()[:3] == [CLS, ids[1, 1], SEP] and ids[0, 3:].tolist() == [0, 0, 0]
    assert out["token_type_ids"].tolist() == [[0] * 6] * 2


def test_truncates_at_max_length_keeping_the_special_tokens(front: TextFrontEnd) -> None:
    ids = front.encode(texts(" ".join(["word"] * 50)))["input_ids"]
    assert ids.shape == (1, 16)
    assert ids[0, 0] == CLS and ids[0, -1] == SEP


def test_rows_of_shape_n_by_1_str_and_bytes_agree(front: TextFrontEnd) -> None:
    flat = front.encode(texts(b"caf\xc3\xa9 au lait", b"tea"))
    column = front.encode(texts("café au lait", "tea").reshape(2, 1))
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(flat[name], column[name])


def test_bad_utf8_names_the_row(front: TextFrontEnd) -> None:
    with pytest.raises(InvalidInput, match=r"row 1: not valid UTF-8"):
        front.encode(texts(b"fine", b"\xff\xfe broken"))


def test_non_text_row_and_bad_shape_are_invalid_input(front: TextFrontEnd) -> None:
    with pytest.raises(InvalidInput, match="row 0: expected text, got int"):
        front.encode(np.array([3], dtype=object))
    with pytest.raises(InvalidInput, match=r"shape \[N\] or \[N, 1\]"):
        front.encode(texts(b"a", b"b").reshape(1, 2))


def test_empty_batch_gives_empty_tensors(front: TextFrontEnd) -> None:
    out = front.encode(texts())
    assert out["input_ids"].shape == (0, 0) and out["input_ids"].dtype == np.int64


def test_tensor_names_follow_the_spec(version_dir: Path) -> None:
    spec = Tokenizer(ids="ids", mask="m", type_ids=None)
    custom = TextFrontEnd(spec, version_dir)
    assert custom.output_names == ["ids", "m"]
    assert sorted(custom.encode(texts("hi"))) == ["ids", "m"]


def test_missing_file_and_bad_max_length_are_config_errors(version_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"'tokenizer\.file' = 'nope\.json'"):
        TextFrontEnd(Tokenizer(file="nope.json"), version_dir)
    with pytest.raises(ConfigError, match=r"'tokenizer\.max_length' = 0"):
        TextFrontEnd(Tokenizer(max_length=0), version_dir)


def test_malformed_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        TextFrontEnd(Tokenizer(), tmp_path)


# --- the bounded prefix ------------------------------------------------------------------------


class RecordingTokenizer:
    """Passes calls to the real tokenizer and keeps the rows it was asked to encode."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.rows: list[str] = []

    def encode_batch(self, rows: list[str]) -> object:
        self.rows.extend(rows)
        return self.inner.encode_batch(rows)  # type: ignore[attr-defined]


def test_cut_text_keeps_whole_words_and_whole_characters() -> None:
    assert cut_text(b"short", 10) == b"short"
    assert cut_text(b"one two three four", 10) == b"one two"  # the cut falls inside "three"
    assert cut_text("one two three four", 10) == "one two"
    assert cut_text(b"abcdefghijklmnop", 10) == b"abcdefghij"  # no space: cut at the limit
    text = "é" * 20  # 2 bytes each: a cut at byte 11 would split a character
    assert cut_text(text.encode(), 11) == ("é" * 5).encode()
    assert cut_text(("日本語" * 10).encode(), 10).decode() == "日本語"  # 9 of 10 bytes


@pytest.mark.parametrize(
    "text",
    [
        " ".join(f"word{i} and more words, with punctuation." for i in range(400)),
        "日本語のテキストと中文文本" * 300,  # no spaces: a character-boundary cut
        "https://example.com/a/very/long/path?" * 200,  # URL-like, few spaces
    ],
)
def test_a_long_text_gives_the_same_ids_as_tokenizing_it_whole(
    front: TextFrontEnd, text: str
) -> None:
    assert len(text.encode()) > front.max_row_bytes  # so it is cut
    whole = front.tokenizer.encode(text)  # no cut: the tokenizer truncates by itself
    for row in (text, text.encode()):
        out = front.encode(texts(row))
        assert out["input_ids"][0].tolist() == whole.ids
        assert out["attention_mask"][0].tolist() == whole.attention_mask


def test_a_huge_text_is_tokenized_from_a_bounded_prefix(version_dir: Path) -> None:
    fresh = TextFrontEnd(Tokenizer(max_length=16), version_dir)
    recorder = RecordingTokenizer(fresh.tokenizer)
    fresh.tokenizer = recorder  # type: ignore[assignment]
    huge = ("lorem ipsum dolor sit amet " * 160_000).encode()  # ~4.3 MB
    out = fresh.encode(texts(huge, b"short"))
    assert fresh.max_row_bytes == 16 * MAX_BYTES_PER_TOKEN
    assert len(recorder.rows[0].encode()) <= fresh.max_row_bytes
    assert len(recorder.rows[0]) > fresh.max_row_bytes // 2  # cut at a word, not far back
    assert recorder.rows[1] == "short"
    assert out["input_ids"].shape == (2, 16)
    assert out["input_ids"][0, 0] == CLS and out["input_ids"][0, -1] == SEP
