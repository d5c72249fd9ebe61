"""The example `minilm` model: ONNX embeddings match sentence-transformers on the same weights."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fulcrum.backends import create_backend
from fulcrum.backends.onnx import OnnxBackend
from fulcrum.config import ModelConfig, TensorSpec, load_model_config
from fulcrum.errors import ConfigError, InvalidInput
from fulcrum.examples import build_examples, minilm_source_dir

CPU_ONLY = {"execution_providers": ["CPUExecutionProvider"]}
SENTENCES = [
    "Hi",
    "The cat sat on the mat.",
    "Latency and throughput pull against each other; batching trades one for the other.",
    "Fulcrum serves models over KServe v2 and OpenAI-compatible routes, measures P50, P90 and "
    "P99 latency, finds the batch size and queue delay that meet a stated SLO, and keeps that "
    "balance at run time with an adaptive batcher, caching and continuous batching for LLMs.",
    "数据并行与模型并行",
]


def texts(rows: list[str], *, column: bool = True) -> np.ndarray:
    array = np.empty(len(rows), dtype=object)
    array[:] = [r.encode() for r in rows]
    return array.reshape(-1, 1) if column else array


def on_cpu(example_repo: Path, **parameters: object) -> ModelConfig:
    """minilm's shipped config on the CPU, whatever the machine (tests/gpu checks CUDA's)."""
    config = load_model_config(example_repo / "minilm" / "config.toml", dir_name="minilm")
    params = {**config.parameters, **CPU_ONLY, **parameters}
    return msgspec.structs.replace(config, parameters=params)


@pytest.fixture(scope="module")
def backend(example_repo: Path) -> OnnxBackend:
    loaded = create_backend(on_cpu(example_repo), example_repo / "minilm" / "1")
    assert isinstance(loaded, OnnxBackend)
    return loaded


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_source_dir()), device="cpu")
    return np.asarray(model.encode(SENTENCES, convert_to_numpy=True))


def test_config_is_what_the_server_expects(example_repo: Path) -> None:
    config = load_model_config(example_repo / "minilm" / "config.toml", dir_name="minilm")
    assert (config.platform, config.max_batch_size, config.instances.count) == ("onnx", 64, 2)
    assert [(t.name, t.datatype, t.shape) for t in config.inputs] == [("text", "BYTES", (1,))]
    assert [(t.name, t.datatype, t.shape) for t in config.outputs] == [
        ("embedding", "FP32", (384,))
    ]
    assert config.tokenizer is not None and config.tokenizer.input == "text"
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.max_queue_delay_ms == 0
    assert config.dynamic_batching.preferred_batch_sizes == (8,)
    assert (config.dynamic_batching.policy, config.dynamic_batching.slo_p99_ms) == ("adaptive", 100)
    assert config.parameters == {
        "intra_op_threads": 1,
        "share_session_between_instances": True,
        "allow_spinning": False,
        "dynamic_block_base": 4,
        "length_bucket_rows": 8,
        "spin_when_idle": True,
    }


def test_embeddings_match_sentence_transformers(
    backend: OnnxBackend, reference: np.ndarray
) -> None:
    out = backend.execute({"text": texts(SENTENCES)})["embedding"]
    assert out.shape == (len(SENTENCES), 384) and out.dtype == np.float32
    cosine = np.sum(out * reference, axis=1) / np.linalg.norm(reference, axis=1)
    assert np.all(1 - cosine <= 1e-4), cosine
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


def test_a_batch_equals_single_requests_despite_padding(backend: OnnxBackend) -> None:
    batched = backend.execute({"text": texts(SENTENCES)})["embedding"]
    singles = np.concatenate(
        [backend.execute({"text": texts([s])})["embedding"] for s in SENTENCES]
    )
    np.testing.assert_allclose(batched, singles, atol=1e-5)


@pytest.mark.parametrize("bucket_rows", [1, 2, 3])
def test_length_buckets_keep_row_order_and_values(
    example_repo: Path, backend: OnnxBackend, bucket_rows: int
) -> None:
    config = on_cpu(example_repo, length_bucket_rows=bucket_rows)
    bucketed = OnnxBackend(config, example_repo / "minilm" / "1")
    rows = SENTENCES * 2
    expected = backend.execute({"text": texts(rows)})["embedding"]
    got = bucketed.execute({"text": texts(rows)})["embedding"]
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_flat_and_column_text_shapes_agree(backend: OnnxBackend) -> None:
    column = backend.execute({"text": texts(SENTENCES[:3])})["embedding"]
    flat = backend.execute({"text": texts(SENTENCES[:3], column=False)})["embedding"]
    np.testing.assert_array_equal(column, flat)


def test_bad_utf8_is_invalid_input_naming_the_row(backend: OnnxBackend) -> None:
    rows = np.array([[b"fine"], [b"\xc3\x28 broken"]], dtype=object)
    with pytest.raises(InvalidInput, match="row 1: not valid UTF-8"):
        backend.execute({"text": rows})


def test_missing_text_input_is_invalid_input(backend: OnnxBackend) -> None:
    with pytest.raises(InvalidInput, match="missing input 'text'"):
        backend.execute({})


def test_token_ids_sent_directly_are_cast_from_int32(
    example_repo: Path, backend: OnnxBackend
) -> None:
    # The same graph without the text front end: clients send int32 token tensors themselves.
    config = on_cpu(example_repo)
    names = ("input_ids", "attention_mask", "token_type_ids")
    config = msgspec.structs.replace(
        config,
        tokenizer=None,
        inputs=tuple(TensorSpec(name=n, datatype="INT64", shape=(-1,)) for n in names),
    )
    with pytest.raises(ConfigError, match="length_bucket_rows"):  # buckets need the tokenizer
        OnnxBackend(config, example_repo / "minilm" / "1")
    params = {k: v for k, v in config.parameters.items() if k != "length_bucket_rows"}
    config = msgspec.structs.replace(config, parameters=params)
    raw = OnnxBackend(config, example_repo / "minilm" / "1")
    assert backend.front is not None
    tokens = backend.front.encode(texts(SENTENCES[:2]))
    narrow = {name: array.astype(np.int32) for name, array in tokens.items()}
    expected = backend.execute({"text": texts(SENTENCES[:2])})["embedding"]
    np.testing.assert_allclose(raw.execute(narrow)["embedding"], expected, atol=1e-6)


def test_rebuilding_is_idempotent_and_keeps_a_tuned_config(tmp_path: Path) -> None:
    assert build_examples(tmp_path) == ["minilm", "tiny-gpt2", "tiny-llama"]
    model_file = tmp_path / "minilm" / "1" / "model.onnx"
    config_file = tmp_path / "minilm" / "config.toml"
    config_file.write_text(
        config_file.read_text().replace("max_batch_size = 64", "max_batch_size = 8")
    )
    before = os.stat(model_file).st_mtime_ns
    assert build_examples(tmp_path) == ["minilm", "tiny-gpt2", "tiny-llama"]
    assert os.stat(model_file).st_mtime_ns == before  # not rewritten
    assert "max_batch_size = 8" in config_file.read_text()
    (tmp_path / "minilm" / "1" / ".build-stamp").write_text("stale\n")
    build_examples(tmp_path)
    assert os.stat(model_file).st_mtime_ns != before  # a stale stamp rebuilds
