"""Model variants through the server: each declared variant loads, a request picks one with the
v2 `variant` parameter or the X-Fulcrum-Variant header, statistics and metrics carry it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fulcrum.server.app import create_app
from fulcrum.service import Service

# A Python model that multiplies by its `scale` parameter: which variant ran shows in the answer.
MODEL_PY = """
import numpy as np

class Model:
    def __init__(self, config, version_dir):
        self.scale = float(config.parameters["scale"])

    def execute(self, batch):
        return {"y": batch["x"] * self.scale}
"""
CONFIG = """# scaled: one model, three variants
platform = "python"
max_batch_size = 4
default_variant = "fp32"

[[inputs]]
name = "x"
datatype = "FP32"
shape = [1]

[[outputs]]
name = "y"
datatype = "FP32"
shape = [1]

[dynamic_batching]

[parameters]
scale = 1.0

[variants.fp32]
precision = "fp32"

[variants.int8]
precision = "int8"
parameters = { scale = 8.0 }

[variants.int4]
precision = "int4"
load = false
parameters = { scale = 4.0 }
"""


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    (tmp_path / "scaled" / "1").mkdir(parents=True)
    (tmp_path / "scaled" / "config.toml").write_text(CONFIG)
    (tmp_path / "scaled" / "1" / "model.py").write_text(MODEL_PY)
    service = Service(tmp_path)
    await service.start()
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c
    await service.stop()


def body(value: float, **parameters: object) -> dict[str, object]:
    request: dict[str, object] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [value]}]
    }
    if parameters:
        request["parameters"] = parameters
    return request


async def answer(client: httpx.AsyncClient, request: dict[str, object], **headers: str) -> float:
    response = await client.post("/v2/models/scaled/infer", json=request, headers=headers)
    assert response.status_code == 200, response.text
    return float(response.json()["outputs"][0]["data"][0])


async def test_the_default_serves_unless_a_request_names_a_variant(
    client: httpx.AsyncClient,
) -> None:
    assert await answer(client, body(2.0)) == 2.0
    assert await answer(client, body(2.0, variant="int8")) == 16.0
    assert await answer(client, body(2.0), **{"X-Fulcrum-Variant": "int8"}) == 16.0
    assert await answer(client, body(2.0, variant="fp32")) == 2.0


async def test_unknown_unloaded_and_contradicting_variants_are_400s(
    client: httpx.AsyncClient,
) -> None:
    unknown = await client.post("/v2/models/scaled/infer", json=body(1.0, variant="fp8"))
    assert unknown.status_code == 400
    assert "no variant 'fp8'" in unknown.json()["error"]
    assert "['fp32', 'int8']" in unknown.json()["error"]
    unloaded = await client.post(
        "/v2/models/scaled/infer", json=body(1.0), headers={"X-Fulcrum-Variant": "int4"}
    )
    assert unloaded.status_code == 400
    assert "load = false" in unloaded.json()["error"]
    both = await client.post(
        "/v2/models/scaled/infer",
        json=body(1.0, variant="fp32"),
        headers={"X-Fulcrum-Variant": "int8"},
    )
    assert both.status_code == 400
    assert "contradicts header" in both.json()["error"]
    bad_type = await client.post("/v2/models/scaled/infer", json=body(1.0, variant=3))
    assert bad_type.status_code == 400
    # The model still serves after every refusal.
    assert await answer(client, body(1.0)) == 1.0


async def test_statistics_and_metrics_carry_the_variant(client: httpx.AsyncClient) -> None:
    await answer(client, body(1.0, variant="int8"))
    await answer(client, body(1.0, variant="int8"))
    await answer(client, body(1.0))
    stats = (await client.get("/v2/models/scaled/stats")).json()["model_stats"]
    counts = {row["variant"]: row["inference_count"] for row in stats}
    assert counts == {"fp32": 1, "int8": 2}
    text = (await client.get("/metrics")).text
    assert (
        'fulcrum_requests_total{model="scaled",outcome="success",variant="int8",version="1"} 2.0'
        in text
    )
    assert 'variant="int4"' not in text


async def test_a_reload_can_switch_the_default_variant(client: httpx.AsyncClient) -> None:
    override = '{"default_variant": "int8"}'
    loaded = await client.post(
        "/v2/repository/models/scaled/load", json={"parameters": {"config": override}}
    )
    assert loaded.status_code == 200, loaded.text
    assert await answer(client, body(1.0)) == 8.0
    bad = await client.post(
        "/v2/repository/models/scaled/load",
        json={"parameters": {"config": '{"default_variant": "int4"}'}},
    )
    assert bad.status_code == 400
    assert "load = false" in bad.json()["error"]
    assert await answer(client, body(1.0)) == 8.0  # the failed reload left the old one serving
