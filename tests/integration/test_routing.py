"""A/B split, shadow traffic and a cascade through the server (python backend): the arm in
`Fulcrum-Route`, per-arm metrics and statistics, an explicit variant winning; shadows bounded,
after the caller, out of the caller's statistics, with their agreement recorded; the cascade's
decision at its threshold and an incompatible second model refused at load."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fulcrum.context import internal_context
from fulcrum.errors import FulcrumError
from fulcrum.routing.ab import arm_of
from fulcrum.servable import BatchServable
from fulcrum.server.app import create_app
from fulcrum.service import Service

# Multiplies by its variant's `scale`; embeds a text as [scale, 1]; `confidence` echoes x (the
# cascade's score). Each batch waits at a gate the test may close, so a shadow can be held.
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
            rows = len(batch["text"])
            return {"embedding": np.tile(np.array([self.scale, 1.0], np.float32), (rows, 1))}
        return {"y": batch["x"] * self.scale, "confidence": batch["x"]}
"""
X = 'inputs = [{name = "x", datatype = "FP32", shape = [1]}]\n'
Y = '{name = "y", datatype = "FP32", shape = [1]}'
SPLIT = """
[parameters]
scale = 1.0
[variants.fp32]
[variants.int8]
parameters = { scale = 8.0 }
[routing.ab]
arms = { fp32 = 0.5, int8 = 0.5 }
[routing.shadow]
variant = "fp32"
fraction = 1.0
max_in_flight = 2
"""
AB = f'platform = "python"\nmax_batch_size = 8\n{X}outputs = [{Y}]\n{SPLIT}compare = "exact"\n'
TEXT = (
    'platform = "python"\nmax_batch_size = 8\n'
    'inputs = [{name = "text", datatype = "BYTES", shape = [1]}]\n'
    'outputs = [{name = "embedding", datatype = "FP32", shape = [2]}]\n' + SPLIT
)
SCORED = f'outputs = [{Y}, {{name = "confidence", datatype = "FP32", shape = [1]}}]\n'
CASCADE = '[routing.cascade]\nthen = "{then}"\nscore_output = "confidence"\nthreshold = 0.5\n'
SMALL = f'platform = "python"\nmax_batch_size = 8\n{X}{SCORED}[parameters]\nscale = 1.0\n'
BIG = f'platform = "python"\nmax_batch_size = 8\n{X}outputs = [{Y}]\n[parameters]\nscale = 100.0\n'
OTHER = BIG.replace('name = "x"', 'name = "z"')
LANED = AB + '[lanes.realtime]\nvariant = "int8"\n[lanes.bulk]\nvariant = "fp32"\n'
CACHED = AB + "[cache]\n"


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    models = (("ab", AB), ("text", TEXT), ("small", SMALL + CASCADE.format(then="big")),
              ("big", BIG), ("other", OTHER), ("laned", LANED), ("cached", CACHED),
              ("wrong", SMALL + CASCADE.format(then="other")))  # fmt: skip
    for name, config in models:
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.toml").write_text(config)
        (tmp_path / name / "1" / "model.py").write_text(MODEL_PY)
    svc = Service(tmp_path)
    await svc.start()
    yield svc
    for model in ("ab", "text"):
        with contextlib.suppress(FulcrumError):
            python_model(svc, model, "fp32").gate.set()
    await svc.stop()


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def servable(service: Service, model: str, variant: str) -> BatchServable:
    found = service._repository.get(model, None, variant)[2]
    assert isinstance(found, BatchServable)
    return found


def python_model(service: Service, model: str, variant: str) -> Any:
    backend: Any = servable(service, model, variant).pool._backends[0]
    return backend.model


def key_for(arm: str, model: str = "ab") -> str:
    return next(f"user-{i}" for i in range(1000) if arm_of(model, f"user-{i}", AB_ARMS) == arm)


AB_ARMS = {"fp32": 0.5, "int8": 0.5}


async def infer(
    client: httpx.AsyncClient, model: str = "ab", value: float = 1.0, **headers: str
) -> httpx.Response:
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [value]}
    return await client.post(f"/v2/models/{model}/infer", json={"inputs": [tensor]},
                             headers=headers)  # fmt: skip


def answer(response: httpx.Response) -> float:
    assert response.status_code == 200, response.text
    return float(response.json()["outputs"][0]["data"][0])


async def routing_stats(client: httpx.AsyncClient, model: str) -> dict[str, Any]:
    rows = (await client.get(f"/v2/models/{model}/stats")).json()["model_stats"]
    found: dict[str, Any] = next(r["routing"] for r in rows if "routing" in r)
    return found


async def test_the_key_picks_a_sticky_arm_named_in_the_route(
    client: httpx.AsyncClient, service: Service
) -> None:
    for arm, scale in (("int8", 8.0), ("fp32", 1.0)):
        key = key_for(arm)
        for _ in range(3):  # the same key, the same arm
            response = await infer(client, **{"X-Fulcrum-AB-Key": key})
            assert answer(response) == scale
            assert response.headers["Fulcrum-Route"] == f"ab={arm}"
    await service.routing.shadows.wait()
    ab = (await routing_stats(client, "ab"))["ab"]
    assert ab["int8"]["success"] == 3 and ab["fp32"]["success"] == 3
    assert ab["int8"]["rows"] == 3 and ab["int8"]["success_ns"] > 0
    metrics = (await client.get("/metrics")).text
    assert 'fulcrum_ab_requests_total{arm="int8",model="ab",outcome="success"} 3.0' in metrics
    assert 'fulcrum_ab_request_duration_seconds_count{arm="fp32",model="ab"} 3.0' in metrics


async def test_without_a_key_the_tenant_is_the_key(client: httpx.AsyncClient) -> None:
    tenant = key_for("int8")
    response = await infer(client, **{"X-Fulcrum-Tenant": tenant})
    assert answer(response) == 8.0


async def test_an_explicit_variant_wins_over_the_split(client: httpx.AsyncClient) -> None:
    response = await infer(client, **{"X-Fulcrum-AB-Key": key_for("int8"),
                                      "X-Fulcrum-Variant": "fp32"})  # fmt: skip
    assert answer(response) == 1.0
    assert "Fulcrum-Route" not in response.headers


async def test_shadows_agree_less_with_a_reference_that_differs(
    client: httpx.AsyncClient, service: Service
) -> None:
    await infer(client, **{"X-Fulcrum-AB-Key": key_for("int8")})  # int8: 8x, fp32: 1x
    await infer(client, **{"X-Fulcrum-AB-Key": key_for("fp32")})  # on the reference: none
    await service.routing.shadows.wait()
    shadow = (await routing_stats(client, "ab"))["shadow"]
    assert shadow == {"reference": "fp32", "sent": 1, "dropped": 0, "failed": 0, "sampled": 0,
                      "compared": 1, "agreement_mean": 0.0}  # fmt: skip
    metrics = (await client.get("/metrics")).text
    assert 'fulcrum_shadow_agreement_count{model="ab",reference="fp32"} 1.0' in metrics


async def test_embedding_shadows_record_their_cosine(
    client: httpx.AsyncClient, service: Service
) -> None:
    body = {"model": "text", "input": ["a", "b"]}
    response = await client.post("/v1/embeddings", json=body,
                                 headers={"X-Fulcrum-AB-Key": key_for("int8", "text")})  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["data"][0]["embedding"] == [8.0, 1.0]
    await service.routing.shadows.wait()
    shadow = (await routing_stats(client, "text"))["shadow"]
    # cos([8, 1], [1, 1]) = 9 / (sqrt(65) * sqrt(2))
    assert shadow["agreement_mean"] == pytest.approx(9 / (65**0.5 * 2**0.5))


async def test_shadows_are_bounded_after_the_caller_and_out_of_its_statistics(
    client: httpx.AsyncClient, service: Service
) -> None:
    reference = python_model(service, "ab", "fp32")
    reference.gate.clear()  # a slow reference: its shadows cannot finish
    key = key_for("int8")
    responses = await asyncio.gather(*(infer(client, **{"X-Fulcrum-AB-Key": key})
                                       for _ in range(10)))  # fmt: skip
    assert [answer(r) for r in responses] == [8.0] * 10  # answered while the shadows wait
    assert service.routing.shadows.in_flight("ab") == 2
    shadow = (await routing_stats(client, "ab"))["shadow"]
    assert (shadow["sent"], shadow["dropped"], shadow["compared"]) == (2, 8, 0)
    reference.gate.set()
    await service.routing.shadows.wait()
    assert service.routing.shadows.in_flight("ab") == 0
    rows = (await client.get("/v2/models/ab/stats")).json()["model_stats"]
    counts = {r["variant"]: r["inference_stats"]["success"]["count"] for r in rows}
    assert counts == {"int8": 10, "fp32": 2}  # the caller's row holds only the callers
    ab = (await routing_stats(client, "ab"))["ab"]
    assert set(ab) == {"int8"} and ab["int8"]["success"] == 10


async def test_shadows_stop_with_the_server(client: httpx.AsyncClient, service: Service) -> None:
    python_model(service, "ab", "fp32").gate.clear()
    await infer(client, **{"X-Fulcrum-AB-Key": key_for("int8")})
    assert service.routing.shadows.in_flight("ab") == 1
    await service.routing.shadows.close()  # as `stop` does first
    assert service.routing.shadows.in_flight("ab") == 0
    python_model(service, "ab", "fp32").gate.set()


@pytest.mark.parametrize(
    ("score", "expected", "route"),
    [(0.49, 49.0, "cascade=escalated; then=big"), (0.5, 0.5, "cascade=first"),
     (0.51, 0.51, "cascade=first")],
)  # fmt: skip
async def test_the_cascade_escalates_below_its_threshold(
    client: httpx.AsyncClient, score: float, expected: float, route: str
) -> None:
    response = await infer(client, "small", score)
    assert answer(response) == pytest.approx(expected)
    assert response.headers["Fulcrum-Route"] == route
    cascade = (await routing_stats(client, "small"))["cascade"]
    assert cascade == {"escalated" if "escalated" in route else "first": 1}
    metrics = (await client.get("/metrics")).text
    assert 'fulcrum_cascade_score_count{model="small"} 1.0' in metrics


async def test_an_incompatible_second_model_is_refused_at_load(service: Service) -> None:
    rows = {r["name"]: r for r in service.model_index(internal_context(), ready_only=False)}
    assert rows["wrong"]["state"] == "UNAVAILABLE"
    assert "routing.cascade.then" in rows["wrong"]["reason"]
    assert "it has no input 'x'" in rows["wrong"]["reason"]


async def test_an_unloaded_models_routing_series_go(
    client: httpx.AsyncClient, service: Service
) -> None:
    await infer(client, **{"X-Fulcrum-AB-Key": key_for("int8")})
    await service.routing.shadows.wait()
    before = (await client.get("/metrics")).text
    assert 'fulcrum_ab_requests_total{arm="int8",model="ab",outcome="success"} 1.0' in before
    assert 'fulcrum_shadow_requests_total{model="ab",outcome="sent"' in before
    await service.unload(internal_context(), "ab")
    metrics = (await client.get("/metrics")).text
    assert 'fulcrum_ab_requests_total{arm="int8",model="ab"' not in metrics
    assert 'fulcrum_shadow_requests_total{model="ab"' not in metrics
    assert service.routing.metrics.stats_json("ab") == {}


async def test_the_arm_picks_the_variant_then_the_lane_router_its_lane(
    client: httpx.AsyncClient,
) -> None:
    for arm, lane, scale in (("int8", "realtime", 8.0), ("fp32", "bulk", 1.0)):
        response = await infer(client, "laned", **{"X-Fulcrum-AB-Key": key_for(arm, "laned")})
        assert answer(response) == scale
        assert response.headers["Fulcrum-Route"] == f"ab={arm}; lane={lane}; by=variant"


async def test_a_shadow_neither_reads_nor_fills_the_result_cache(
    client: httpx.AsyncClient, service: Service
) -> None:
    first = await infer(client, "cached", 3.0, **{"X-Fulcrum-AB-Key": key_for("int8", "cached")})
    assert answer(first) == 24.0
    await service.routing.shadows.wait()
    assert (await routing_stats(client, "cached"))["shadow"]["compared"] == 1
    # The same inputs on the reference: had the shadow filled its cache, this would be a hit.
    reference = await infer(client, "cached", 3.0, **{"X-Fulcrum-Variant": "fp32"})
    assert answer(reference) == 3.0
    assert reference.headers["Fulcrum-Cache"] == "miss"
