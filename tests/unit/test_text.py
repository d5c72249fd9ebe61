from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from fulcrum.backends.text import TextFrontEnd
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
