"""The official clients, unchanged, against the Ray ingress: answers equal to an in-process
`Service` over the same repository (what single-process `fulcrum serve` runs)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from ray_cluster import Cluster
from tritonclient.utils import InferenceServerException

from fulcrum.context import RequestContext
from fulcrum.protocol import InferRequest
from fulcrum.service import Service, ServiceSettings

pytestmark = pytest.mark.ray
CTX = RequestContext(request_id="in-process", tenant="default", api="v2")


@pytest.fixture(scope="module")
def triton(cluster: Cluster) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(cluster.url.removeprefix("http://"), concurrency=4)
    yield client
    client.close()


def in_process_infer(repository: Path, model: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The same request through an in-process Service (single-process `fulcrum serve`)."""

    async def run() -> np.ndarray:
        service = Service(repository, ServiceSettings(load_models=(model,)))
        await service.start()
        try:
            request = InferRequest(None, inputs, (), False, None, None, {})
            _, result = await service.infer(CTX, model, None, request)
            return next(iter(result.outputs.values()))
        finally:
            await service.stop()

    return asyncio.run(run())


def test_health_metadata_and_config(triton: httpclient.InferenceServerClient) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("echo")
    meta = triton.get_model_metadata("echo")
    assert meta["name"] == "echo" and meta["inputs"][0]["name"] == "x"
    assert triton.get_model_config("echo")["max_batch_size"] == 8
    assert triton.get_server_metadata()["name"] == "fulcrum"


@pytest.mark.parametrize("binary", [False, True])
def test_echo_infer_equals_in_process(
    cluster: Cluster, triton: httpclient.InferenceServerClient, binary: bool
) -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = httpclient.InferInput("x", [3, 4], "FP32")
    x.set_data_from_numpy(data, binary_data=binary)
    out = httpclient.InferRequestedOutput("y", binary_data=binary)
    result = triton.infer("echo", [x], outputs=[out])
    expected = in_process_infer(cluster.repository, "echo", {"x": data})
    np.testing.assert_array_equal(result.as_numpy("y"), expected)
    assert result.get_response()["model_version"] == "1"


def test_unknown_model_and_bad_input_keep_their_status(
    triton: httpclient.InferenceServerClient,
) -> None:
    x = httpclient.InferInput("x", [1, 3], "FP32")  # per-row shape is [4]
    x.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    with pytest.raises(InferenceServerException) as bad:
        triton.infer("echo", [x])
    assert bad.value.status() == "400"
    with pytest.raises(InferenceServerException) as missing:
        triton.infer("no-such-model", [x])
    assert missing.value.status() == "404"


def test_minilm_embeddings_equal_in_process(
    cluster: Cluster, triton: httpclient.InferenceServerClient
) -> None:
    if "minilm" not in cluster.models:
        pytest.fail("the [examples] extra is installed with [all]; minilm must be in the test run")
    texts = ["A cat sat on the warm windowsill.", "Dynamic batching trades latency."]
    data = np.array([[t.encode()] for t in texts], dtype=object)
    text = httpclient.InferInput("text", [2, 1], "BYTES")
    text.set_data_from_numpy(data, binary_data=True)
    result = triton.infer("minilm", [text])
    expected = in_process_infer(cluster.repository, "minilm", {"text": data})
    np.testing.assert_allclose(result.as_numpy("embedding"), expected, rtol=1e-5, atol=1e-6)


def test_infer_stream_rows_come_back_in_order_across_replicas(cluster: Cluster) -> None:
    rows = [[float(i), float(i), float(i), float(i)] for i in range(20)]  # 20 rows: 3 chunks of 8
    tensor = {"name": "x", "datatype": "FP32", "shape": [20, 4], "data": rows}
    url = f"{cluster.url}/v2/models/echo/infer_stream"
    response = httpx.post(url, json={"inputs": [tensor]}, timeout=60)
    assert response.status_code == 200, response.text
    blocks = [b for b in response.text.split("\n\n") if b.strip()]
    received: list[list[float]] = []
    for block in blocks:
        event = json.loads(block.removeprefix("data: "))
        assert event["parameters"]["row_offset"] == len(received)
        flat = event["outputs"][0]["data"]
        received.extend(flat[i : i + 4] for i in range(0, len(flat), 4))
    assert received == rows and len(blocks) > 1
