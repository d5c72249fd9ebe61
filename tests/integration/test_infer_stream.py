"""`POST /v2/models/{m}/infer_stream` in process: rows come back as server-sent events, in order
and complete, the first chunk before the batches of the rest; errors before the stream are
ordinary responses, a failing later chunk ends it with an error event, and a client that goes
away leaves nothing queued. The raw-ASGI tests watch events arrive one by one (httpx's
ASGITransport hands a response over only once it is complete)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette

from fulcrum.batcher import DynamicBatcher
from fulcrum.loadgen.bench import BenchOptions, run_bench_async
from fulcrum.loadgen.kserve import V2Inputs
from fulcrum.loadgen.windows import MeasurePlan
from fulcrum.servable import BatchServable
from fulcrum.server.app import create_app
from fulcrum.service import Service

ECHO = """platform = "echo"
max_batch_size = {max_batch_size}
inputs = [{{name = "x", datatype = "FP32", shape = [2]}}]
outputs = [{{name = "y", datatype = "FP32", shape = [2]}}]
parameters = {{latency_a_ms = 1.0, fail_value = -1.0}}
[dynamic_batching]
max_queue_delay_ms = 1
{extra}
"""
# A Python model that holds back every batch whose rows all lie at or past `limit` (row i holds
# x = i) until the test raises it: the first event must arrive while the rest cannot have run.
GATED_PY = """
import threading

class Model:
    def __init__(self):
        self.limit = 2.0
        self.changed = threading.Condition()
        self.num_batches = 0

    def open_below(self, limit):
        with self.changed:
            self.limit = limit
            self.changed.notify_all()

    def execute(self, batch):
        x = batch["x"]
        self.num_batches += 1
        with self.changed:
            self.changed.wait_for(lambda: float(x.min()) < self.limit, timeout=30)
        return {"y": x}
"""
GATED = """platform = "python"
max_batch_size = 8
inputs = [{name = "x", datatype = "FP32", shape = [2]}]
outputs = [{name = "y", datatype = "FP32", shape = [2]}]
[dynamic_batching]
"""
FIRST_ROWS = 2
MODELS = {
    "echo": ECHO.format(max_batch_size=8, extra=""),
    "mixed": ECHO.format(max_batch_size=8, extra='profile = "mixed"\nslo_p99_ms = 10000'),
    "bounded": ECHO.format(max_batch_size=2, extra="default_queue_policy = {max_queue_size = 2}"),
    "single": ECHO.split("[dynamic_batching]")[0].format(max_batch_size=0),
    "gated": GATED,
}


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    for name, config in MODELS.items():
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.toml").write_text(config)
    (tmp_path / "gated" / "1" / "model.py").write_text(GATED_PY)
    svc = Service.from_repository(tmp_path)
    await svc.start()
    yield svc
    gated_model(svc).open_below(float("inf"))  # a failed test must not leave a batch waiting
    await svc.stop()


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def servable_of(service: Service, name: str) -> BatchServable:
    servable = service._repository.get(name)[2]
    assert isinstance(servable, BatchServable)
    return servable


def batcher_of(service: Service, name: str) -> DynamicBatcher:
    return servable_of(service, name).batcher


def gated_model(service: Service) -> Any:
    return servable_of(service, "gated").pool._backends[0].model


def rows(num_rows: int, *, fail_at: int | None = None) -> list[list[float]]:
    """Row i is [i, i + 0.5]; row `fail_at` holds the echo model's fail_value."""
    return [[-1.0, -1.0] if i == fail_at else [float(i), i + 0.5] for i in range(num_rows)]


def body(data: list[list[float]], **parameters: object) -> dict[str, object]:
    tensor = {"name": "x", "datatype": "FP32", "shape": [len(data), 2], "data": data}
    return {"id": "r1", "inputs": [tensor], "parameters": parameters}


def events_of(text: str) -> list[dict[str, Any]]:
    """The `data:` payloads of an event stream, in order."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [json.loads(b.removeprefix("data: ")) for b in blocks]


def rows_of(events: list[dict[str, Any]]) -> list[list[float]]:
    """The streamed rows in arrival order, checking each event's offset follows the last."""
    received: list[list[float]] = []
    for event in events:
        params = event["parameters"]
        assert params["row_offset"] == len(received)
        [output] = event["outputs"]
        assert output["shape"] == [params["num_rows"], 2]
        flat = output["data"]
        received.extend(flat[i : i + 2] for i in range(0, len(flat), 2))
    return received


@pytest.mark.parametrize("model", ["echo", "mixed"])
async def test_rows_arrive_in_order_complete_and_marked_final(
    client: httpx.AsyncClient, service: Service, model: str
) -> None:
    data = rows(50)  # 6 chunks: 8 rows first, then 8 at a time (max_batch_size)
    response = await client.post(f"/v2/models/{model}/infer_stream", json=body(data))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response.text)
    assert [e["parameters"]["num_rows"] for e in events] == [8, 8, 8, 8, 8, 8, 2]
    assert [e["parameters"]["final"] for e in events] == [False] * 6 + [True]
    assert {(e["model_name"], e["model_version"], e["id"]) for e in events} == {(model, "1", "r1")}
    assert rows_of(events) == data
    assert batcher_of(service, model).queue_depth == 0


async def test_stream_equals_infer_for_the_same_request(client: httpx.AsyncClient) -> None:
    request = body(rows(7), first_rows=2, chunk_rows=3)
    request["outputs"] = [{"name": "y"}]
    plain = (await client.post("/v2/models/echo/infer", json=request)).json()
    response = await client.post("/v2/models/echo/versions/1/infer_stream", json=request)
    events = events_of(response.text)
    assert [e["parameters"]["num_rows"] for e in events] == [2, 3, 2]
    [output] = plain["outputs"]
    assert rows_of(events) == [output["data"][i : i + 2] for i in range(0, 14, 2)]
    assert {e["outputs"][0]["datatype"] for e in events} == {output["datatype"]}


async def test_a_model_without_batching_answers_in_one_event(client: httpx.AsyncClient) -> None:
    tensor = {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}
    response = await client.post("/v2/models/single/infer_stream", json={"inputs": [tensor]})
    [event] = events_of(response.text)
    assert event["parameters"] == {"row_offset": 0, "num_rows": 1, "final": True}
    assert event["outputs"][0]["data"] == [1.0, 2.0]


@pytest.mark.parametrize(
    ("request_body", "status", "says"),
    [
        (body(rows(20), first_rows=0), 400, "first_rows"),
        (body(rows(20), chunk_rows=9), 400, "chunk_rows"),
        (body(rows(20), binary_data_output=True), 400, "JSON tensors only"),
        ({"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]}]},
         400, "datatype"),
        ({"inputs": [{"name": "z", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]},
         400, "unknown input"),
        ({**body(rows(3)), "outputs": [{"name": "nope"}]}, 400, "unknown output"),
    ],
)  # fmt: skip
async def test_bad_input_is_a_400_before_the_stream(
    client: httpx.AsyncClient, service: Service, request_body: object, status: int, says: str
) -> None:
    response = await client.post("/v2/models/echo/infer_stream", json=request_body)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert says in response.json()["error"]
    assert batcher_of(service, "echo").queue_depth == 0


async def test_unknown_model_and_passed_deadline_are_plain_errors(
    client: httpx.AsyncClient,
) -> None:
    missing = await client.post("/v2/models/nope/infer_stream", json=body(rows(3)))
    assert missing.status_code == 404
    late = await client.post(
        "/v2/models/echo/infer_stream", json=body(rows(3)), headers={"X-Fulcrum-Timeout-Ms": "0"}
    )
    assert late.status_code == 504 and "deadline" in late.json()["error"]


async def test_a_stream_the_queue_cannot_hold_is_a_503_and_leaves_nothing_queued(
    client: httpx.AsyncClient, service: Service
) -> None:
    # 10 rows in chunks of 2: five requests against a queue of two.
    response = await client.post("/v2/models/bounded/infer_stream", json=body(rows(10)))
    assert response.status_code == 503 and "Retry-After" in response.headers
    assert batcher_of(service, "bounded").queue_depth == 0


async def test_a_failing_later_chunk_ends_the_stream_with_an_error_event(
    client: httpx.AsyncClient, service: Service
) -> None:
    data = rows(20, fail_at=12)  # chunks [0,2) [2,10) [10,18) [18,20): the third fails
    response = await client.post(
        "/v2/models/echo/infer_stream", json=body(data, first_rows=2, chunk_rows=8)
    )
    assert response.status_code == 200
    *row_events, error = events_of(response.text)
    assert rows_of(row_events) == data[:10]
    assert not any(e["parameters"]["final"] for e in row_events)
    assert error["code"] == 500 and "fail_value" in error["error"]
    assert batcher_of(service, "echo").queue_depth == 0


class AsgiCall:
    """One POST driven through the raw ASGI interface: each message the app sends is seen as it
    is sent, and the client can go away at any moment."""

    def __init__(self, app: Starlette, path: str, payload: object) -> None:
        self.messages: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
        self.gone = asyncio.Event()
        self.stalled = False  # True: the client stops reading; body sends block until it leaves
        self._body: bytes | None = json.dumps(payload).encode()
        scope = {
            "type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
            "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "http_version": "1.1", "scheme": "http", "server": ("test", 80),
            "client": ("c", 1), "root_path": "",
        }  # fmt: skip
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        if self._body is not None:
            message = {"type": "http.request", "body": self._body, "more_body": False}
            self._body = None
            return message
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: MutableMapping[str, Any]) -> None:
        if self.stalled and message["type"] == "http.response.body":
            await asyncio.Event().wait()  # until the app gives up on this send (cancelled)
        await self.messages.put(message)

    async def status(self) -> int:
        async with asyncio.timeout(10):
            start = await self.messages.get()
        return int(start["status"])

    async def next_event(self) -> dict[str, Any]:
        async with asyncio.timeout(10):
            message = await self.messages.get()
        [event] = events_of(message["body"].decode())
        return event


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop (no timed sleep) until `condition` holds; 10 s at most."""
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0)


async def test_first_rows_arrive_while_the_rest_are_held_back(service: Service) -> None:
    model = gated_model(service)
    data = rows(20)  # chunks [0,2) [2,10) [10,18) [18,20)
    call = AsgiCall(create_app(service, manage_lifespan=False), "/v2/models/gated/infer_stream",
                    body(data, first_rows=FIRST_ROWS))  # fmt: skip
    assert await call.status() == 200
    first = await call.next_event()
    assert first["parameters"] == {"row_offset": 0, "num_rows": FIRST_ROWS, "final": False}
    # The rest cannot have run: every later batch waits for the limit, still at 2.
    assert model.limit == FIRST_ROWS and call.messages.empty()
    model.open_below(float("inf"))
    events = [first] + [await call.next_event() for _ in range(3)]
    assert rows_of(events) == data and events[-1]["parameters"]["final"] is True
    await call.task


async def test_a_client_that_leaves_cancels_the_queued_chunks(service: Service) -> None:
    model = gated_model(service)
    batcher = batcher_of(service, "gated")
    call = AsgiCall(create_app(service, manage_lifespan=False), "/v2/models/gated/infer_stream",
                    body(rows(20), first_rows=FIRST_ROWS))  # fmt: skip
    assert await call.status() == 200
    await call.next_event()
    await until(lambda: model.num_batches == 2)  # [2,10) runs (held); [10,18), [18,20) queue
    assert batcher.queue_depth == 2
    call.gone.set()
    await until(lambda: batcher.queue_depth == 0)
    model.open_below(float("inf"))
    await call.task
    await until(lambda: batcher.num_in_flight == 0)
    assert model.num_batches == 2  # the queued chunks never ran
    assert call.messages.empty()  # nothing more was sent after the client left


async def test_a_client_that_stops_reading_then_leaves_cancels_the_queued_chunks(
    service: Service,
) -> None:
    # The app is stuck sending an event when the client leaves: Starlette cancels that send,
    # not the stream's iterator, and the response must still cancel what is queued.
    model = gated_model(service)
    batcher = batcher_of(service, "gated")
    call = AsgiCall(create_app(service, manage_lifespan=False), "/v2/models/gated/infer_stream",
                    body(rows(20), first_rows=FIRST_ROWS))  # fmt: skip
    assert await call.status() == 200
    await call.next_event()
    call.stalled = True
    model.open_below(10)  # [2,10) finishes, its event blocks in send; [10,18) runs (held)
    await until(lambda: model.num_batches == 3)
    assert batcher.queue_depth == 1  # [18,20)
    call.gone.set()
    await until(lambda: batcher.queue_depth == 0)
    model.open_below(float("inf"))
    await call.task
    await until(lambda: batcher.num_in_flight == 0)
    assert model.num_batches == 3  # [18,20) never ran


class ThreadServer:
    """uvicorn on a free loopback port, in a thread with its own event loop."""

    def __init__(self, app: Starlette) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:  # startup takes a few ms; no fixed sleep
            assert self.thread.is_alive(), "server thread died"
            threading.Event().wait(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


BENCH_A_MS = 10.0


async def test_bench_stream_rows_measures_time_to_first_rows(tmp_path: Path) -> None:
    (tmp_path / "echo" / "1").mkdir(parents=True)
    config = ECHO.format(max_batch_size=8, extra="").replace("1.0,", f"{BENCH_A_MS},")
    (tmp_path / "echo" / "config.toml").write_text(config)
    plan = MeasurePlan(warmup_s=0.2, window_s=0.5, max_duration_s=1.0)
    with ThreadServer(create_app(Service.from_repository(tmp_path))) as url:
        options = BenchOptions(
            model="echo", url=url, concurrency=(2,), plan=plan,
            v2=V2Inputs(batch_size=40, stream_rows=True),
        )  # fmt: skip
        run = await run_bench_async(options)
    [point] = run.points
    assert run.stream_rows and point.num_ok > 0 and not point.errors
    assert point.rows_per_s == pytest.approx(40 * point.throughput_rps)
    first = point.first_rows
    assert first is not None and first.count == point.num_ok
    # 40 rows are 5 chunks of 8, each a batch of at least BENCH_A_MS on the one instance: the
    # first rows arrive after one batch, the whole answer after all five.
    assert first.p50_ms >= BENCH_A_MS and point.latency.p50_ms >= 5 * BENCH_A_MS
    assert first.p50_ms < point.latency.p50_ms
