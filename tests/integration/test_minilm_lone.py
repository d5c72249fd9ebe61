"""minilm with `spin_when_idle`: the two sessions share the word-embedding table and agree."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from fulcrum.backends import create_backend
from fulcrum.backends.onnx import OnnxBackend
from fulcrum.config import load_model_config


def test_the_spinning_session_shares_the_embedding_table_and_answers_bitwise_alike(
    example_repo: Path,
) -> None:
    folder = example_repo / "minilm"
    config = load_model_config(folder / "config.toml", dir_name="minilm")
    # A CPU matter: a model on CUDA builds no spinning session.
    cpu = ["CPUExecutionProvider"]
    params = {**config.parameters, "spin_when_idle": True, "execution_providers": cpu}
    backend = create_backend(msgspec.structs.replace(config, parameters=params), folder / "1")
    assert isinstance(backend, OnnxBackend) and backend.lone_session is not None
    # all-MiniLM-L6-v2's vocabulary x hidden size, in float32: the one table only Gather reads.
    tables = {name: value.numpy() for name, value in backend.shared_weights.items()}
    assert [t.shape for t in tables.values()] == [(30522, 384)]
    words = ["Hi", "The cat sat on the mat.", "Latency and throughput pull against each other."]
    for rows in (1, 3):
        batch = {"text": np.array([[w.encode()] for w in words[:rows]], dtype=object)}
        plain = backend._execute(backend.session, batch)
        lone = backend._execute(backend.lone_session, batch)
        assert np.array_equal(plain["embedding"], lone["embedding"])
    backend.close()
