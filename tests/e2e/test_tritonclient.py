"""The official Triton HTTP client, unchanged, against a real `fulcrum serve` with `minilm`."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

SENTENCES = [
    "Dynamic batching trades a little latency for a lot of throughput.",
    "A cat sat on the warm windowsill.",
    "Short.",
]


@pytest.fixture(scope="module")
def client(server_url: str) -> Iterator[httpclient.InferenceServerClient]:
    triton = httpclient.InferenceServerClient(server_url.removeprefix("http://"), concurrency=4)
    yield triton
    triton.close()


def embed(
    client: httpclient.InferenceServerClient, texts: list[str], *, binary: bool
) -> np.ndarray:
    data = np.array([[t.encode()] for t in texts], dtype=object)
    text = httpclient.InferInput("text", list(data.shape), "BYTES")
    text.set_data_from_numpy(data, binary_data=binary)
    output = httpclient.InferRequestedOutput("embedding", binary_data=binary)
    result = client.infer("minilm", [text], outputs=[output])
    embedding = result.as_numpy("embedding")
    assert embedding is not None
    return embedding


def test_health_and_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("minilm")
    meta = client.get_model_metadata("minilm")
    assert meta["name"] == "minilm"
    assert meta["inputs"][0]["name"] == "text" and meta["inputs"][0]["datatype"] == "BYTES"
    out = meta["outputs"][0]
    assert (out["name"], out["datatype"], out["shape"][-1]) == ("embedding", "FP32", 384)
    assert client.get_server_metadata()["name"] == "fulcrum"
    assert client.get_model_config("minilm")["max_batch_size"] >= 8


@pytest.mark.parametrize("binary", [False, True])
def test_infer_json_and_binary(client: httpclient.InferenceServerClient, binary: bool) -> None:
    vectors = embed(client, SENTENCES[:1], binary=binary)
    assert vectors.shape == (1, 384) and vectors.dtype == np.float32
    assert abs(float(np.linalg.norm(vectors[0])) - 1.0) < 1e-4


def test_batched_request_equals_single_requests(client: httpclient.InferenceServerClient) -> None:
    batched = embed(client, SENTENCES, binary=True)
    singles = np.concatenate([embed(client, [s], binary=True) for s in SENTENCES])
    np.testing.assert_allclose(batched, singles, atol=1e-5)


def test_async_requests_are_batched_and_counted(client: httpclient.InferenceServerClient) -> None:
    data = np.array([[b"hello world"]], dtype=object)
    text = httpclient.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(data, binary_data=True)
    pending = [client.async_infer("minilm", [text]) for _ in range(16)]
    results = [p.get_result().as_numpy("embedding") for p in pending]
    for r in results:
        assert r is not None
        np.testing.assert_allclose(r, results[0], atol=1e-5)
    stats = client.get_inference_statistics("minilm")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] >= 16
    assert stats["batch_stats"]


def test_errors_reach_the_client(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="nope"):
        client.get_model_metadata("nope")
    bad = httpclient.InferInput("text", [1, 1], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 1), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="FP32"):
        client.infer("minilm", [bad])
    index = client.get_model_repository_index()
    assert any(row["name"] == "minilm" for row in index)
