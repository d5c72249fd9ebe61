"""Request inputs: tensors shaped by metadata, text lengths, JSONL rows, prepared requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fulcrum.client import Endpoint
from fulcrum.errors import InvalidInput
from fulcrum.loadgen.inputs import (
    LengthDist,
    ModelMeta,
    TensorMeta,
    num_rows_of,
    read_jsonl,
    synthetic_inputs,
    tensors_from_row,
)
from fulcrum.loadgen.kserve import V2Inputs, prepare_v2

BERT = ModelMeta(
    name="bert",
    inputs=[
        TensorMeta("input_ids", "INT64", [-1, -1]),
        TensorMeta("attention_mask", "INT64", [-1, -1]),
        TensorMeta("token_type_ids", "INT64", [-1, -1]),
    ],
)
TEXT = ModelMeta(name="minilm", inputs=[TensorMeta("text", "BYTES", [-1])])


def test_token_tensors_share_one_length_and_fill_masks() -> None:
    rng = np.random.default_rng(0)
    tensors = synthetic_inputs(BERT, num_rows=4, lengths=LengthDist(7, 7), rng=rng, vocab_size=50)
    assert {t.shape for t in tensors.values()} == {(4, 7)}
    assert tensors["input_ids"].dtype == np.int64
    assert tensors["input_ids"].max() < 50
    assert np.all(tensors["attention_mask"] == 1) and np.all(tensors["token_type_ids"] == 0)
    assert num_rows_of(BERT, tensors) == 4


def test_text_inputs_follow_the_length_distribution() -> None:
    rng = np.random.default_rng(1)
    dist = LengthDist.parse("4-12")
    counts = []
    for _ in range(300):
        tensors = synthetic_inputs(TEXT, num_rows=2, lengths=dist, rng=rng)
        text = tensors["text"]
        assert text.shape == (2,) and text.dtype == np.object_
        counts.append(len(text[0].split()))
    assert min(counts) == 4 and max(counts) == 12
    assert np.mean(counts) == pytest.approx(8, abs=0.5)


def test_fixed_shape_float_input() -> None:
    meta = ModelMeta(name="m", inputs=[TensorMeta("x", "FP32", [-1, 3, 2])])
    tensors = synthetic_inputs(
        meta, num_rows=5, lengths=LengthDist(1, 1), rng=np.random.default_rng()
    )
    assert tensors["x"].shape == (5, 3, 2) and tensors["x"].dtype == np.float32


@pytest.mark.parametrize(
    ("text", "want"),
    [("16", LengthDist(16, 16)), ("8-64", LengthDist(8, 64)), ("32:4", LengthDist(32, 32, 4.0))],
)
def test_length_parse(text: str, want: LengthDist) -> None:
    assert LengthDist.parse(text) == want


@pytest.mark.parametrize("text", ["0", "9-3", "a", "5:-1"])
def test_bad_length(text: str) -> None:
    with pytest.raises(InvalidInput):
        LengthDist.parse(text)


def test_jsonl_rows_become_batched_tensors(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text('{"text": "hello world"}\n\n{"text": "a longer sentence here"}\n')
    rows = read_jsonl(path)
    assert len(rows) == 2
    tensors = tensors_from_row(TEXT, rows[1], num_rows=3)
    assert tensors["text"].shape == (3,)
    assert tensors["text"][2] == b"a longer sentence here"
    meta = ModelMeta(name="m", inputs=[TensorMeta("ids", "INT32", [-1, -1])])
    ids = tensors_from_row(meta, {"ids": [1, 2, 3]}, num_rows=2)["ids"]
    assert ids.shape == (2, 3) and ids.dtype == np.int32
    with pytest.raises(InvalidInput, match="none of the model's inputs"):
        tensors_from_row(TEXT, {"other": 1}, num_rows=1)
    (tmp_path / "bad.jsonl").write_text("[1, 2]\n")
    with pytest.raises(InvalidInput, match="expected a JSON object"):
        read_jsonl(tmp_path / "bad.jsonl")


def test_prepared_requests_are_complete_http_posts() -> None:
    endpoint = Endpoint.from_url("http://127.0.0.1:9999")
    requests = prepare_v2(endpoint, TEXT, V2Inputs(batch_size=2, num_distinct=3))
    assert len(requests) == 3 and all(r.num_rows == 2 for r in requests)
    head, _, body = requests[0].raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v2/models/minilm/infer HTTP/1.1"
    assert f"Content-Length: {len(body)}" in lines
    assert b'"name":"text"' in body and b'"shape":[2]' in body
    assert len({r.raw for r in requests}) == 3  # distinct bodies
    with pytest.raises(InvalidInput):
        prepare_v2(endpoint, TEXT, V2Inputs(batch_size=0))


def test_jsonl_file_of_v2_bodies_and_name_value_rows(tmp_path: Path) -> None:
    path = tmp_path / "real.jsonl"
    body = (
        '{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": ["a", "b", "c"]}]}'
    )
    path.write_text(body + "\n" + '{"text": "hello"}\n')
    endpoint = Endpoint.from_url("http://127.0.0.1:9999")
    first, second = prepare_v2(endpoint, TEXT, V2Inputs(batch_size=2, input_file=path))
    assert first.num_rows == 3  # a complete body keeps its own batch
    assert first.raw.endswith(b'"data":["a","b","c"]}]}')
    assert second.num_rows == 2
    path.write_text('{"inputs": [{"name": "text"}]}\n')
    with pytest.raises(InvalidInput, match="v2 request"):
        prepare_v2(endpoint, TEXT, V2Inputs(input_file=path))
