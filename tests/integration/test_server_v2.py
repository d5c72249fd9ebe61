"""The KServe v2 surface in process (httpx.ASGITransport) over echo models."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from fulcrum.client import parse_server_timing
from fulcrum.context import internal_context
from fulcrum.protocol import decode_infer_response, encode_infer_request
from fulcrum.server.app import create_app
from fulcrum.service import Service, ServiceSettings

ECHO = """
platform = "echo"
max_batch_size = 8
[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [4]
[dynamic_batching]
max_queue_delay_ms = 1
{extra}
[parameters]
{params}
"""

MODELS = {
    "echo": ("", "latency_a_ms = 1.0"),
    "failing": ("", "fail_value = -1.0"),
    "tiny_queue": (
        "[dynamic_batching.default_queue_policy]\nmax_queue_size = 1",
        "latency_a_ms = 200.0",
    ),
    "deadline": (
        "[dynamic_batching.default_queue_policy]\ndefault_timeout_ms = 20",
        "latency_a_ms = 100.0",
    ),
}


def write_repo(root: Path) -> Path:
    for name, (extra, params) in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text(ECHO.format(extra=extra, params=params))
    return root


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    svc = Service.from_repository(write_repo(tmp_path), ServiceSettings(max_body_bytes=4096))
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service, manage_lifespan=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def infer_json(
    rows: list[list[float]], name: str = "x", datatype: str = "FP32"
) -> dict[str, object]:
    flat = [v for row in rows for v in row]
    return {"inputs": [{"name": name, "datatype": datatype, "shape": [len(rows), 4], "data": flat}]}


async def test_health_and_metadata(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/health/live")).status_code == 200
    assert (await client.get("/v2/health/ready")).status_code == 200
    meta = (await client.get("/v2")).json()
    assert meta["name"] == "fulcrum" and "binary_tensor_data" in meta["extensions"]
    model = (await client.get("/v2/models/echo")).json()
    assert model["name"] == "echo" and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert (await client.get("/v2/models/echo/ready")).status_code == 200
    assert (await client.get("/v2/models/echo/versions/1/ready")).status_code == 200
    assert (await client.get("/v2/models/echo/config")).json()["max_batch_size"] == 8


async def test_json_infer_round_trip(client: httpx.AsyncClient) -> None:
    response = await client.post("/v2/models/echo/infer", json=infer_json([[1, 2, 3, 4]]))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == "echo" and body["model_version"] == "1"
    assert body["outputs"][0]["data"] == [1, 2, 3, 4]
    assert body["outputs"][0]["shape"] == [1, 4]
    timing = response.headers["server-timing"]
    assert "queue;dur=" in timing and "compute;dur=" in timing
    # total (handler start -> response built) holds the queue wait and the compute
    durations = parse_server_timing(timing)
    assert durations["total"] >= durations["queue"] + durations["compute"] >= 1.0  # echo's 1 ms


async def test_binary_infer_round_trip(client: httpx.AsyncClient) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    body, headers = encode_infer_request({"x": x}, binary=True)
    response = await client.post("/v2/models/echo/versions/1/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    length = response.headers.get("inference-header-content-length")
    _, outputs = decode_infer_response(response.content, int(length) if length else None)
    np.testing.assert_array_equal(outputs["y"], x)


@pytest.mark.parametrize(
    ("path", "payload", "status", "fragment"),
    [
        ("/v2/models/nope/infer", infer_json([[1, 2, 3, 4]]), 404, "nope"),
        ("/v2/models/echo/infer", infer_json([[1, 2, 3, 4]], name="z"), 400, "z"),
        ("/v2/models/echo/infer", infer_json([[1, 2, 3, 4]], datatype="INT32"), 400, "INT32"),
        ("/v2/models/echo/infer", infer_json([[1, 2, 3]] * 1), 400, "x"),
        ("/v2/models/echo/infer", infer_json([[1, 2, 3, 4]] * 9), 400, "9"),
        ("/v2/models/echo/versions/x/infer", infer_json([[1, 2, 3, 4]]), 400, "version"),
        ("/v2/models/echo/versions/5/infer", infer_json([[1, 2, 3, 4]]), 404, "5"),
        ("/v2/models/..%2Fetc/infer", infer_json([[1, 2, 3, 4]]), 404, ""),
    ],
)
async def test_bad_requests_name_the_problem(
    client: httpx.AsyncClient, path: str, payload: dict[str, object], status: int, fragment: str
) -> None:
    response = await client.post(path, json=payload)
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]


async def test_malformed_json_and_body_limit(client: httpx.AsyncClient) -> None:
    response = await client.post("/v2/models/echo/infer", content=b"{nope")
    assert response.status_code == 400 and response.json()["error"]
    big = b'{"inputs": [' + b" " * 5000 + b"]}"
    response = await client.post("/v2/models/echo/infer", content=big)
    assert response.status_code == 413 and "4096" in response.json()["error"]


async def test_model_error_fails_only_its_batch(client: httpx.AsyncClient) -> None:
    bad = await client.post("/v2/models/failing/infer", json=infer_json([[-1, 0, 0, 0]]))
    assert bad.status_code == 500 and "fail_value" in bad.json()["error"]
    good = await client.post("/v2/models/failing/infer", json=infer_json([[1, 0, 0, 0]]))
    assert good.status_code == 200


async def test_one_malformed_among_32_concurrent(client: httpx.AsyncClient) -> None:
    payloads = [infer_json([[i, i, i, i]]) for i in range(32)]
    payloads[7] = infer_json([[1, 2, 3]])
    responses = await asyncio.gather(
        *(client.post("/v2/models/echo/infer", json=p) for p in payloads)
    )
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 31 and statuses[7] == 400
    for i, r in enumerate(responses):
        if i != 7:
            assert r.json()["outputs"][0]["data"] == [i] * 4  # each client got its own rows


async def test_queue_full_is_503_with_retry_after(client: httpx.AsyncClient) -> None:
    responses = await asyncio.gather(
        *(
            client.post("/v2/models/tiny_queue/infer", json=infer_json([[1, 1, 1, 1]]))
            for _ in range(6)
        )
    )
    rejected = [r for r in responses if r.status_code == 503]
    assert rejected, [r.status_code for r in responses]
    assert all("retry-after" in r.headers for r in rejected)
    assert any(r.status_code == 200 for r in responses)


async def test_deadline_in_queue_is_504(client: httpx.AsyncClient, service: Service) -> None:
    # the first request fills a whole batch and holds the only instance for 100 ms; the others
    # wait in the queue past their 20 ms default timeout
    payloads = [infer_json([[1, 1, 1, 1]] * 8), infer_json([[2, 2, 2, 2]]), infer_json([[3] * 4])]
    responses = await asyncio.gather(
        *(client.post("/v2/models/deadline/infer", json=p) for p in payloads)
    )
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 504, 504], statuses
    assert "timed out" in responses[1].json()["error"]
    stats = service.statistics(internal_context(), "deadline", None)["model_stats"][0]
    assert stats["execution_count"] == 1  # the expired requests never ran
    assert stats["inference_stats"]["fail"]["count"] == 2


async def test_repository_load_unload(client: httpx.AsyncClient) -> None:
    index = (await client.post("/v2/repository/index", json={})).json()
    assert {r["name"] for r in index} == set(MODELS)
    assert (await client.post("/v2/repository/models/echo/unload")).status_code == 200
    gone = await client.post("/v2/models/echo/infer", json=infer_json([[1, 2, 3, 4]]))
    assert gone.status_code == 404
    assert (await client.get("/v2/models/echo/ready")).status_code == 400
    override = {"parameters": {"config": '{"max_batch_size": 2}'}}
    assert (await client.post("/v2/repository/models/echo/load", json=override)).status_code == 200
    config = (await client.get("/v2/models/echo/config")).json()
    assert config["max_batch_size"] == 2
    bad = await client.post("/v2/repository/models/..%2F..%2Fetc/load")
    assert bad.status_code in (400, 404)


async def test_statistics_and_metrics(client: httpx.AsyncClient) -> None:
    for _ in range(3):
        await client.post("/v2/models/echo/infer", json=infer_json([[1, 2, 3, 4], [5, 6, 7, 8]]))
    await client.post("/v2/models/junk-model-name/infer", json=infer_json([[1, 2, 3, 4]]))
    stats = (await client.get("/v2/models/echo/stats")).json()["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 3
    assert (
        sum(b["compute_infer"]["count"] for b in stats["batch_stats"]) == stats["execution_count"]
    )
    assert {b["batch_size"] for b in stats["batch_stats"]} <= {2, 4, 6}
    text = (await client.get("/metrics")).text
    labels = 'model="echo",variant="default",version="1"'
    assert f'fulcrum_request_duration_seconds_bucket{{le="0.0005",{labels}}}' in text
    assert f"fulcrum_batch_size_count{{{labels}}}" in text
    assert "junk-model-name" not in text


async def test_management_closed_without_token(service: Service) -> None:
    app = create_app(service, admin_open=False, manage_lifespan=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.post("/v2/repository/index")).status_code == 403
    app = create_app(service, admin_token="s3cret", manage_lifespan=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.post("/v2/repository/index")).status_code == 403
        ok = await c.post("/v2/repository/index", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/nothing/here")).status_code == 404
    assert (await client.get("/v2/models/echo/infer")).status_code == 405
