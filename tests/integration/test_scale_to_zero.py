"""Scale to zero through the server, both APIs, with a fake clock: an idle model unloads, shows
as unloaded in the index but stays ready, and its next request loads it (health answering while
a slow load runs); the user's unload and reload keep their meaning; an LLM parks and wakes."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
import types
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.server.app import create_app
from fulcrum.service import Service, ServiceSettings
from fulcrum.types import FakeClock

IDLE = "\n[lifecycle]\nidle_unload_s = 60\n"
ECHO = """platform = "echo"
max_batch_size = 4
[[inputs]]
name = "x"
datatype = "FP32"
shape = [1]
[[outputs]]
name = "x"
datatype = "FP32"
shape = [1]
"""
SLOW = """platform = "python"
max_batch_size = 4
[[inputs]]
name = "x"
datatype = "FP32"
shape = [1]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [1]
"""
# Its constructor (run on a worker thread by the load) waits for the test to open the gate.
SLOW_MODEL = """
import sys

class Model:
    def __init__(self):
        gates = sys.modules["lifecycle_test_gates"]
        gates.started.set()
        gates.gate.wait(30)

    def execute(self, batch):
        return {"y": batch["x"] + 1}
"""
TINY = """platform = "llm"
[parameters]
num_kv_blocks = 64
block_size = 4
max_model_len = 128
"""
X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [2.0]}]}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root: Path = tmp_path_factory.mktemp("models")
    build_tiny_gpt2(root, name="tiny")
    (root / "tiny" / "config.toml").write_text(TINY + IDLE)
    for name, config in (("echo", ECHO), ("slow", SLOW)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text(config + IDLE)
    (root / "slow" / "1" / "model.py").write_text(SLOW_MODEL)
    return root


@pytest.fixture
def gates() -> Iterator[types.SimpleNamespace]:
    namespace = types.SimpleNamespace(gate=threading.Event(), started=threading.Event())
    namespace.gate.set()  # start-up loads pass
    sys.modules["lifecycle_test_gates"] = namespace  # type: ignore[assignment]
    yield namespace
    namespace.gate.set()  # never leave a load thread waiting
    del sys.modules["lifecycle_test_gates"]


class Server:
    def __init__(self, service: Service, clock: FakeClock, client: httpx.AsyncClient) -> None:
        self.service, self.clock, self.client = service, clock, client

    async def idle(self) -> None:
        """Every model idle past its idle time: the sweep unloads them."""
        self.clock.advance(61.0)
        await self.service._lifecycle.sweep()

    async def state(self, name: str) -> tuple[str, str]:
        rows = (await self.client.post("/v2/repository/index", json={})).json()
        row = next(r for r in rows if r["name"] == name)
        return row["state"], row["reason"]

    async def metric(self, line_start: str) -> str:
        text = (await self.client.get("/metrics")).text
        return next(line for line in text.splitlines() if line.startswith(line_start))


@pytest.fixture
async def server(repo: Path, gates: types.SimpleNamespace) -> AsyncIterator[Server]:
    clock = FakeClock(1000.0)
    service = Service(repo, clock=clock)
    await service.start()
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield Server(service, clock, client)
    await service.stop()


async def test_idle_model_unloads_and_its_next_request_loads_it(server: Server) -> None:
    c = server.client
    assert (await c.post("/v2/models/echo/infer", json=X)).status_code == 200
    servable = weakref.ref(server.service._repository.get("echo")[2])
    await server.idle()
    assert await server.state("echo") == ("UNAVAILABLE", "unloaded (idle)")
    gc.collect()
    assert servable() is None  # its instances closed and released
    # Ready while parked (a request loads it); metadata answered without loading it.
    assert (await c.get("/v2/models/echo/ready")).status_code == 200
    assert (await c.get("/v2/models/echo")).json()["versions"] == ["1"]
    assert (await c.get("/v2/models/echo/config")).json()["max_batch_size"] == 4
    assert (await c.get("/v2/models/echo/stats")).json() == {"model_stats": []}
    assert (await c.get("/v2/health/ready")).status_code == 200
    assert await server.state("echo") == ("UNAVAILABLE", "unloaded (idle)")
    response = await c.post("/v2/models/echo/infer", json=X)
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [2.0]
    assert await server.state("echo") == ("READY", "")
    assert await server.metric('fulcrum_model_cold_start_seconds_count{model="echo"}') == (
        'fulcrum_model_cold_start_seconds_count{model="echo"} 1.0'
    )
    assert await server.metric('fulcrum_model_unloads_total{model="echo"') == (
        'fulcrum_model_unloads_total{model="echo",reason="idle"} 1.0'
    )
    row = (await c.get("/v2/models/echo/stats")).json()["model_stats"][0]
    assert row["lifecycle"]["cold_start"]["count"] == 1
    assert row["lifecycle"]["idle_unloads"] == 1


async def test_concurrent_first_requests_share_one_load(server: Server) -> None:
    await server.idle()
    responses = await asyncio.gather(
        *(server.client.post("/v2/models/echo/infer", json=X) for _ in range(8))
    )
    assert [r.status_code for r in responses] == [200] * 8
    assert await server.metric('fulcrum_model_cold_start_seconds_count{model="echo"}') == (
        'fulcrum_model_cold_start_seconds_count{model="echo"} 1.0'
    )


async def test_health_answers_while_a_slow_load_runs(
    server: Server, gates: types.SimpleNamespace
) -> None:
    c = server.client
    await server.idle()
    gates.gate.clear()
    gates.started.clear()
    infer = asyncio.create_task(c.post("/v2/models/slow/infer", json=X))
    assert await asyncio.to_thread(gates.started.wait, 10)  # the load runs, on its thread
    assert (await c.get("/v2/health/live")).status_code == 200
    assert (await c.get("/v2/health/ready")).status_code == 200
    assert (await c.post("/v2/models/echo/infer", json=X)).status_code == 200  # not behind it
    assert await server.state("slow") == ("LOADING", "unloaded (idle)")
    assert not infer.done()  # parked, not failed
    gates.gate.set()
    response = await infer
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [3.0]


async def test_explicit_unload_is_not_reloaded_by_traffic(server: Server) -> None:
    c = server.client
    await server.idle()
    assert (await c.post("/v2/repository/models/echo/unload", json={})).status_code == 200
    response = await c.post("/v2/models/echo/infer", json=X)
    assert response.status_code == 404
    assert "not loaded" in response.json()["error"]
    assert (await c.get("/v2/models/echo/ready")).status_code == 400
    assert await server.state("echo") == ("UNAVAILABLE", "unloaded")
    assert (await c.post("/v2/repository/models/echo/load", json={})).status_code == 200
    assert (await c.post("/v2/models/echo/infer", json=X)).status_code == 200


async def test_reload_of_a_parked_model_takes_its_config_for_the_next_load(
    server: Server,
) -> None:
    c = server.client
    await server.idle()
    override = {"parameters": {"config": json.dumps({"max_batch_size": 2})}}
    assert (await c.post("/v2/repository/models/echo/load", json=override)).status_code == 200
    assert await server.state("echo") == ("UNAVAILABLE", "unloaded (idle)")
    assert (await c.get("/v2/models/echo/config")).json()["max_batch_size"] == 2
    assert (await c.post("/v2/models/echo/infer", json=X)).status_code == 200
    assert (await c.get("/v2/models/echo/config")).json()["max_batch_size"] == 2


async def test_llm_parks_and_wakes_for_an_openai_request(server: Server) -> None:
    c = server.client
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    assert (await c.post("/v1/completions", json=body)).status_code == 200
    engine = weakref.ref(server.service._repository.get("tiny")[2])
    await server.idle()
    assert await server.state("tiny") == ("UNAVAILABLE", "unloaded (idle)")
    gc.collect()
    assert engine() is None  # nothing keeps the stopped engine (and its weights) alive
    cards = (await c.get("/v1/models")).json()["data"]
    assert [(m["id"], m.get("max_model_len")) for m in cards] == [("tiny", 128)]
    response = await c.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
    assert await server.metric('fulcrum_model_cold_start_seconds_count{model="tiny"}') == (
        'fulcrum_model_cold_start_seconds_count{model="tiny"} 1.0'
    )


async def test_an_embedding_model_parks_and_wakes_for_openai_embeddings(example_repo: Path) -> None:
    """minilm, given an idle time by a load override (the session's repository stays as is)."""
    clock = FakeClock(0.0)
    service = Service(example_repo, ServiceSettings(load_models=()), clock=clock)
    await service.start()
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    override = {"parameters": {"config": json.dumps({"lifecycle": {"idle_unload_s": 60}})}}
    body = {"model": "minilm", "input": ["scale to zero"]}
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        assert (await c.post("/v2/repository/models/minilm/load", json=override)).status_code == 200
        first = (await c.post("/v1/embeddings", json=body)).json()["data"][0]["embedding"]
        clock.advance(61.0)
        await service._lifecycle.sweep()
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["minilm"]
        response = await c.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["data"][0]["embedding"] == pytest.approx(first, abs=1e-6)
        stats = (await c.get("/v2/models/minilm/stats")).json()["model_stats"][0]["lifecycle"]
        assert (stats["idle_unloads"], stats["cold_start"]["count"]) == (1, 1)
        assert stats["memory_bytes"] >= 80 * 2**20  # at least its weights on disk
    await service.stop()
