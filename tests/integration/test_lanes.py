"""Lanes through the server, both APIs: a lane by header or parameter, by deadline, spill-over
when the home lane is full, failover when it is down, 503 + Retry-After when no lane can, the
route in `Fulcrum-Route` and the metrics, and a laned model reloaded under load."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fulcrum.errors import FulcrumError
from fulcrum.lanes.group import LaneGroup
from fulcrum.servable import BatchServable
from fulcrum.server.app import create_app
from fulcrum.service import Service

# Multiplies by its variant's `scale` (which lane served shows in the answer); each batch waits
# at a gate the test may close, so a lane can be held busy without sleeping.
MODEL_PY = """
import threading
import numpy as np

class Model:
    def __init__(self, config, version_dir):
        self.scale = float(config.parameters["scale"])
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def execute(self, batch):
        self.entered.set()
        self.gate.wait(timeout=30)
        if "text" in batch:
            return {"embedding": np.full((len(batch["text"]), 2), self.scale, np.float32)}
        return {"y": batch["x"] * self.scale}
"""
LANES = """
[dynamic_batching]
slo_p99_ms = 30000  # far beyond any estimate on a loaded machine: bulk spills only when full
default_queue_policy = { max_queue_size = 1 }

[parameters]
scale = 1.0

[variants.fp32]
[variants.int8]
parameters = { scale = 8.0 }

[lanes.realtime]
variant = "int8"
[lanes.realtime.dynamic_batching]
profile = "realtime"
slo_p99_ms = 50
default_queue_policy = { max_queue_size = 1 }

[lanes.bulk]
variant = "fp32"
"""
SCALED = (
    'platform = "python"\nmax_batch_size = 8\ndefault_lane = "bulk"\n'
    'inputs = [{name = "x", datatype = "FP32", shape = [1]}]\n'
    'outputs = [{name = "y", datatype = "FP32", shape = [1]}]\n' + LANES
)
TEXT = (
    'platform = "python"\nmax_batch_size = 8\ndefault_lane = "bulk"\n'
    'inputs = [{name = "text", datatype = "BYTES", shape = [1]}]\n'
    'outputs = [{name = "embedding", datatype = "FP32", shape = [2]}]\n' + LANES
)
ECHO = """platform = "echo"
max_batch_size = 8
inputs = [{name = "x", datatype = "FP32", shape = [1]}]
outputs = [{name = "x", datatype = "FP32", shape = [1]}]
[dynamic_batching]
[parameters]
latency_a_ms = 1.0
[variants.fp32]
[variants.int8]
parameters = { latency_a_ms = 0.5 }
[lanes.realtime]
variant = "int8"
[lanes.bulk]
variant = "fp32"
instances = { count = 2 }
"""


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    models = (("scaled", SCALED), ("text", TEXT), ("echo", ECHO), ("cached", ECHO + "[cache]\n"))
    for name, config in models:
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.toml").write_text(config)
        (tmp_path / name / "1" / "model.py").write_text(MODEL_PY)
    svc = Service(tmp_path)
    await svc.start()
    yield svc
    for lane in ("realtime", "bulk"):
        with contextlib.suppress(FulcrumError):  # (unloaded by the test)
            model_of(svc, lane).gate.set()  # a failed test must not leave a batch waiting
    await svc.stop()


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def lane_of(service: Service, lane: str, model: str = "scaled") -> BatchServable:
    variant = "int8" if lane == "realtime" else "fp32"
    group = service._repository.get(model, None, variant)[2]
    assert isinstance(group, LaneGroup)
    return group.lanes[lane]


def model_of(service: Service, lane: str) -> Any:
    backend: Any = lane_of(service, lane).pool._backends[0]  # the Python backend
    return backend.model


def body(value: float = 1.0, **parameters: object) -> dict[str, object]:
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [value]}
    return {"inputs": [tensor], "parameters": parameters}


async def infer(
    client: httpx.AsyncClient, request: dict[str, object] | None = None, /, **headers: str
) -> httpx.Response:
    return await client.post("/v2/models/scaled/infer", json=request or body(), headers=headers)


def served_scale(response: httpx.Response) -> float:
    assert response.status_code == 200, response.text
    return float(response.json()["outputs"][0]["data"][0])


async def hold(service: Service, lane: str) -> asyncio.Task[httpx.Response]:
    """Close the lane's gate and fill it: one request running, one queued (its bound)."""
    model = model_of(service, lane)
    model.gate.clear()
    model.entered.clear()
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    client = httpx.AsyncClient(transport=transport, base_url="http://test")
    running = asyncio.ensure_future(infer(client, **{"X-Fulcrum-Lane": lane}))
    assert await asyncio.to_thread(model.entered.wait, 10)
    queued = asyncio.ensure_future(infer(client, **{"X-Fulcrum-Lane": lane}))
    servable = lane_of(service, lane)
    while servable.queue_depth < 1 and not queued.done():  # it reaches the batcher's queue
        await asyncio.sleep(0)
    assert not queued.done()
    assert servable.is_full()

    async def release() -> httpx.Response:
        try:
            first = await running
            await queued
            return first
        finally:
            await client.aclose()

    return asyncio.ensure_future(release())


async def test_a_lane_by_header_or_parameter_and_the_default(client: httpx.AsyncClient) -> None:
    by_header = await infer(client, **{"X-Fulcrum-Lane": "realtime"})
    assert served_scale(by_header) == 8.0
    assert by_header.headers["Fulcrum-Route"] == "lane=realtime; by=name"
    by_parameter = await infer(client, body(lane="realtime"))
    assert served_scale(by_parameter) == 8.0
    default = await infer(client)
    assert served_scale(default) == 1.0
    assert default.headers["Fulcrum-Route"] == "lane=bulk; by=default"


async def test_a_streamed_answer_says_its_route(client: httpx.AsyncClient) -> None:
    response = await client.post("/v2/models/scaled/infer_stream", json=body(2.0, lane="realtime"))
    assert response.status_code == 200, response.text
    assert response.headers["Fulcrum-Route"] == "lane=realtime; by=name"
    assert '"data":[16.0]' in response.text.replace(" ", "")


async def test_unknown_and_contradicting_lanes_are_400s(client: httpx.AsyncClient) -> None:
    unknown = await infer(client, body(lane="fast"))
    assert unknown.status_code == 400
    assert "no lane 'fast' (lanes: ['realtime', 'bulk'])" in unknown.json()["error"]
    both = await infer(client, body(lane="bulk"), **{"X-Fulcrum-Lane": "realtime"})
    assert both.status_code == 400
    assert "contradicts header X-Fulcrum-Lane" in both.json()["error"]


async def test_the_deadline_chooses_the_lane(client: httpx.AsyncClient) -> None:
    tight = await infer(client, **{"X-Fulcrum-Timeout-Ms": "200"})
    assert served_scale(tight) == 8.0
    assert tight.headers["Fulcrum-Route"] == "lane=realtime; by=deadline"
    loose = await infer(client, **{"X-Fulcrum-Timeout-Ms": "60000"})
    assert served_scale(loose) == 1.0
    # The v2 `timeout` parameter (microseconds) is a deadline too.
    assert served_scale(await infer(client, body(timeout=200_000))) == 8.0


async def test_a_full_lane_spills_to_one_that_can_take_it(
    service: Service, client: httpx.AsyncClient
) -> None:
    held = await hold(service, "bulk")
    spilled = await infer(client)
    assert served_scale(spilled) == 8.0
    assert spilled.headers["Fulcrum-Route"] == "lane=realtime; by=default; spilled-from=bulk"
    model_of(service, "bulk").gate.set()
    assert served_scale(await held) == 1.0
    metrics = (await client.get("/metrics")).text
    assert 'fulcrum_lane_routes_total{lane="realtime",model="scaled",outcome="spilled"} 1.0' in (
        metrics
    )


async def test_no_lane_with_room_is_a_503_with_retry_after(
    service: Service, client: httpx.AsyncClient
) -> None:
    held = [await hold(service, "bulk"), await hold(service, "realtime")]
    refused = await infer(client)
    assert refused.status_code == 503
    assert int(refused.headers["Retry-After"]) >= 1
    assert "no lane has room in time" in refused.json()["error"]
    for lane in ("bulk", "realtime"):
        model_of(service, lane).gate.set()
    assert [served_scale(await h) for h in held] == [1.0, 8.0]
    metrics = (await client.get("/metrics")).text
    assert 'fulcrum_lane_routes_total{lane="bulk",model="scaled",outcome="refused"} 1.0' in metrics


async def test_a_lane_that_is_down_fails_over(service: Service, client: httpx.AsyncClient) -> None:
    await lane_of(service, "realtime").stop()  # stopping: not ready, takes nothing
    failed_over = await infer(client, **{"X-Fulcrum-Lane": "realtime"})
    assert served_scale(failed_over) == 1.0
    assert failed_over.headers["Fulcrum-Route"] == ("lane=bulk; by=name; failed-over-from=realtime")
    await lane_of(service, "bulk").stop()
    refused = await infer(client)
    assert refused.status_code == 503
    assert "no lane is healthy" in refused.json()["error"]
    assert refused.headers["Retry-After"] == "1"


async def test_embeddings_take_lanes_by_header(client: httpx.AsyncClient) -> None:
    request = {"model": "text", "input": ["a", "b"]}
    fast = await client.post("/v1/embeddings", json=request, headers={"X-Fulcrum-Lane": "realtime"})
    assert fast.status_code == 200, fast.text
    assert [row["embedding"] for row in fast.json()["data"]] == [[8.0, 8.0], [8.0, 8.0]]
    assert fast.headers["Fulcrum-Route"] == "lane=realtime; by=name"
    bulk = await client.post("/v1/embeddings", json=request)
    assert bulk.json()["data"][0]["embedding"] == [1.0, 1.0]
    assert bulk.headers["Fulcrum-Route"] == "lane=bulk; by=default"


async def test_a_cached_answer_says_its_route_and_its_cache(client: httpx.AsyncClient) -> None:
    headers = {"X-Fulcrum-Lane": "realtime"}
    first = await client.post("/v2/models/cached/infer", json=body(3.0), headers=headers)
    again = await client.post("/v2/models/cached/infer", json=body(3.0), headers=headers)
    assert [r.headers["Fulcrum-Cache"] for r in (first, again)] == ["miss", "exact"]
    assert again.headers["Fulcrum-Route"] == "lane=realtime; by=name"
    assert again.json()["outputs"][0]["data"] == [3.0]


async def test_each_lane_reports_its_own_statistics(client: httpx.AsyncClient) -> None:
    await infer(client, **{"X-Fulcrum-Lane": "realtime"})
    stats = (await client.get("/v2/models/scaled/stats")).json()["model_stats"]
    counts = {row["variant"]: row["inference_stats"]["success"]["count"] for row in stats}
    assert counts == {"int8@realtime": 1, "fp32@bulk": 0}


async def test_a_laned_model_reloads_under_load_without_a_failure(
    service: Service, client: httpx.AsyncClient
) -> None:
    statuses: list[int] = []
    stop = asyncio.Event()

    async def load(lane: str | None) -> None:
        headers = {"X-Fulcrum-Lane": lane} if lane else {}
        while not stop.is_set():
            response = await client.post("/v2/models/echo/infer", json=body(2.0), headers=headers)
            statuses.append(response.status_code)

    workers = [asyncio.ensure_future(load(lane)) for lane in ("realtime", "bulk", None) * 3]
    old = lane_of(service, "realtime", model="echo")
    for _ in range(3):
        before = len(statuses)
        await service.load(service_ctx(), "echo")
        while len(statuses) < before + 20 and not any(w.done() for w in workers):
            await asyncio.sleep(0)  # requests ran across the switch
    stop.set()
    await asyncio.gather(*workers)
    assert lane_of(service, "realtime", model="echo") is not old
    assert len(statuses) >= 60
    assert set(statuses) == {200}


def service_ctx() -> Any:
    from fulcrum.context import internal_context

    return internal_context("management")


async def test_an_unloaded_model_leaves_no_route_series(
    service: Service, client: httpx.AsyncClient
) -> None:
    await infer(client, **{"X-Fulcrum-Lane": "realtime"})
    assert (
        'fulcrum_lane_routes_total{lane="realtime",model="scaled"'
        in (await client.get("/metrics")).text
    )
    await service.unload(service_ctx(), "scaled")
    assert (
        'fulcrum_lane_routes_total{lane="realtime",model="scaled"'
        not in (await client.get("/metrics")).text
    )


class RowsSeen:
    """A router in front of the service's own, recording each request's row count."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rows: list[int] = []

    def route(self, ctx: Any, model: str, version: int | None) -> Any:
        self.rows.append(ctx.num_rows)
        return self.inner.route(ctx, model, version)


async def test_the_router_is_told_each_requests_rows(
    client: httpx.AsyncClient, service: Service
) -> None:
    seen = service.router = RowsSeen(service.router)
    tensor = {"name": "x", "datatype": "FP32", "shape": [5, 1], "data": [1.0] * 5}
    assert served_scale(await infer(client, {"inputs": [tensor]})) in (1.0, 8.0)
    texts = {"model": "text", "input": ["a", "b", "c"]}
    assert (await client.post("/v1/embeddings", json=texts)).status_code == 200
    assert seen.rows == [5, 3]
