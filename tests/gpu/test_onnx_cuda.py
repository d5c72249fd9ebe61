"""minilm on ONNX Runtime's CUDA provider: chosen by default when present, same embeddings."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import onnxruntime as ort
import pytest

from fulcrum.backends.onnx import OnnxBackend
from fulcrum.config import load_model_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs onnxruntime with the CUDA execution provider (onnxruntime-gpu and a GPU)",
    ),
]


def test_cuda_provider_is_default_and_matches_cpu(example_repo: Path) -> None:
    folder = example_repo / "minilm"
    config = load_model_config(folder / "config.toml", dir_name="minilm")
    gpu = OnnxBackend(config, folder / "1")
    assert gpu.session.get_providers()[0] == "CUDAExecutionProvider"
    cpu_params = {**config.parameters, "execution_providers": ["CPUExecutionProvider"]}
    cpu = OnnxBackend(msgspec.structs.replace(config, parameters=cpu_params), folder / "1")
    texts = np.array(
        [[b"hello world"], [b"a longer sentence about batching on a GPU"]], dtype=object
    )
    np.testing.assert_allclose(
        gpu.execute({"text": texts})["embedding"], cpu.execute({"text": texts})["embedding"],
        atol=1e-4,
    )  # fmt: skip
