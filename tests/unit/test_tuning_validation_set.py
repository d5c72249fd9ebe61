"""The validation rows `fulcrum quantize` checks variants on: the JSONL reader and the generator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fulcrum.config import ModelConfig, TensorSpec, Tokenizer
from fulcrum.errors import InvalidInput
from fulcrum.tuning.validation_set import (
    generate_validation,
    load_validation,
    read_validation,
)

TEXT = ModelConfig(
    name="enc",
    platform="onnx",
    max_batch_size=8,
    inputs=(TensorSpec(name="text", datatype="BYTES", shape=(1,)),),
    tokenizer=Tokenizer(),
)
TENSOR = ModelConfig(
    name="clf",
    platform="onnx",
    max_batch_size=8,
    inputs=(
        TensorSpec(name="x", datatype="FP32", shape=(3,)),
        TensorSpec(name="ids", datatype="INT64", shape=(-1,)),
    ),
)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    return path


def test_reads_text_rows_and_labels(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"text": "a cat", "label": 1}\n\n{"text": "two dogs", "label": 0}\n')
    rows = read_validation(TEXT, path)
    assert rows.num_rows == 2
    assert rows.inputs["text"].shape == (2, 1)
    assert rows.inputs["text"][1, 0] == "two dogs"
    assert rows.labels == (1, 0)
    assert rows.source == str(path)


def test_reads_tensor_rows_in_the_config_datatype(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"x": [1, 2, 3], "ids": [4, 5]}\n{"x": [0, 0, 1], "ids": [6, 7]}\n')
    rows = read_validation(TENSOR, path)
    assert rows.inputs["x"].dtype == np.float32
    assert rows.inputs["ids"].dtype == np.int64
    assert rows.inputs["x"].shape == (2, 3)
    assert rows.labels is None


def test_a_bad_json_line_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"text": "fine"}\n{"text": "broken"\n')
    with pytest.raises(InvalidInput, match=r"rows.jsonl line 2: not valid JSON"):
        read_validation(TEXT, path)


def test_rows_must_name_the_model_inputs(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"text": "fine"}\n{"txt": "typo"}\n')
    with pytest.raises(InvalidInput, match=r"line 2: .*unknown \['txt'\], missing \['text'\]"):
        read_validation(TEXT, path)


def test_labels_on_every_row_or_none(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"text": "a", "label": 1}\n{"text": "b"}\n')
    with pytest.raises(InvalidInput, match="line 2: every row or none"):
        read_validation(TEXT, path)
    bad = _write(tmp_path, '{"text": "a", "label": "cat"}\n')
    with pytest.raises(InvalidInput, match="class index"):
        read_validation(TEXT, bad)


def test_text_input_must_be_text_and_shapes_must_match(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="must be text"):
        read_validation(TEXT, _write(tmp_path, '{"text": 3}\n'))
    ragged = _write(tmp_path, '{"x": [1, 2, 3], "ids": [1]}\n{"x": [1, 2], "ids": [1]}\n')
    with pytest.raises(InvalidInput, match="'x': rows are not FP32 tensors of one shape"):
        read_validation(TENSOR, ragged)


def test_empty_or_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="no rows"):
        read_validation(TEXT, _write(tmp_path, "\n"))
    with pytest.raises(InvalidInput, match="cannot read"):
        read_validation(TEXT, tmp_path / "absent.jsonl")


def test_generated_sentences_vary_in_length_and_repeat_with_the_seed() -> None:
    rows = generate_validation(TEXT, num_rows=32, seed=3)
    texts = [str(t) for t in rows.inputs["text"][:, 0]]
    word_counts = {len(t.split()) for t in texts}
    assert len(word_counts) >= 3  # several lengths, not one
    assert rows.source == "generated"
    again = generate_validation(TEXT, num_rows=32, seed=3)
    assert list(again.inputs["text"][:, 0]) == texts


def test_generated_tensors_follow_the_specs() -> None:
    rows = load_validation(TENSOR, None, num_rows=5, seed=0)
    assert rows.inputs["x"].shape == (5, 3) and rows.inputs["x"].dtype == np.float32
    assert rows.inputs["ids"].shape == (5, 8)  # a -1 dimension gets 8
    assert rows.inputs["ids"].min() >= 0 and rows.inputs["ids"].max() < 10


def test_generation_needs_declared_inputs() -> None:
    bare = ModelConfig(name="m", platform="onnx")
    with pytest.raises(InvalidInput, match="give --validation FILE"):
        generate_validation(bare, num_rows=4)
