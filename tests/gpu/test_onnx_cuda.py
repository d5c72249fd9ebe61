"""ONNX Runtime's CUDA provider: chosen by default when present, same embeddings as the CPU
(within TF32's rounding, ORT's default for CUDA matrix products), rows that stay their own
when instances share one CUDA session, and padding that changes no row."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import numpy as np
import onnxruntime as ort
import pytest

from fulcrum.backends.onnx import OnnxBackend
from fulcrum.config import Instances, ModelConfig, TensorSpec, load_model_config
from onnx_graphs import write_matmul_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs onnxruntime with the CUDA execution provider (onnxruntime-gpu and a GPU)",
    ),
]

# TF32 keeps 10 bits of mantissa: MiniLM's unit-length embeddings (entries ~0.05) moved by
# up to 1.6e-4 against float32 on the CPU (an H200, ORT 1.31.1); 1e-3 is well past rounding
# and far below a wrong row.
ATOL = 1e-3
WIDTH = 64


def _texts(rows: list[str]) -> np.ndarray:
    return np.array([[r.encode()] for r in rows], dtype=object)


SENTENCES = ["hello world", "a longer sentence about batching on a GPU", "Hi", "数据并行"]


def test_cuda_provider_is_default_and_matches_cpu(example_repo: Path) -> None:
    folder = example_repo / "minilm"
    config = load_model_config(folder / "config.toml", dir_name="minilm")
    gpu = OnnxBackend(config, folder / "1")
    assert gpu.session.get_providers()[0] == "CUDAExecutionProvider"
    assert gpu.lone_session is None  # `spin_when_idle` is a CPU matter
    cpu_params = {**config.parameters, "execution_providers": ["CPUExecutionProvider"]}
    cpu = OnnxBackend(msgspec.structs.replace(config, parameters=cpu_params), folder / "1")
    on_gpu = gpu.execute({"text": _texts(SENTENCES)})["embedding"]
    on_cpu = cpu.execute({"text": _texts(SENTENCES)})["embedding"]
    np.testing.assert_allclose(on_gpu, on_cpu, atol=ATOL)
    cosine = np.sum(on_gpu * on_cpu, axis=1)  # both unit length
    assert np.all(cosine > 0.9999)
    # Padding to the batch's longest row (and length buckets) changes no row on CUDA either.
    singles = np.concatenate([gpu.execute({"text": _texts([s])})["embedding"] for s in SENTENCES])
    np.testing.assert_allclose(on_gpu, singles, atol=ATOL)
    gpu.close()
    cpu.close()


def test_instances_sharing_one_cuda_session_each_get_their_own_rows(tmp_path: Path) -> None:
    weights = np.random.default_rng(1).standard_normal((WIDTH, WIDTH)).astype(np.float32)
    write_matmul_graph(tmp_path / "model.onnx", weights)
    config = ModelConfig(
        name="mm",
        platform="onnx",
        max_batch_size=8,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(WIDTH,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(WIDTH,)),),
        instances=Instances(count=4),
        parameters={"share_session_between_instances": True},
    )
    backend = OnnxBackend(config, tmp_path)
    assert backend.session.get_providers()[0] == "CUDAExecutionProvider"
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((1 + i % 8, WIDTH)).astype(np.float32) for i in range(800)]
    wrong: list[int] = []
    start = threading.Barrier(4)

    def run(offset: int) -> None:
        start.wait(30)
        for i in range(offset, len(batches), 4):
            y = backend.execute({"x": batches[i]})["y"]
            expected = batches[i] @ weights  # entries ~8: TF32 moves them by ~1e-2 at most
            if not np.allclose(y, expected, rtol=1e-2, atol=5e-2):
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []
    backend.close()
