"""The ingress's facade and the replica's HTTP relay without a cluster: `RayService` over fake
deployment handles (what it sends, what it answers, what it refuses), and `run_asgi` streaming a
response back in pieces."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from fulcrum.batcher import InferResult
from fulcrum.context import RequestContext
from fulcrum.errors import InvalidInput, NotFound
from fulcrum.protocol import InferRequest
from fulcrum.ray.aggregate import ReplicaSnapshot
from fulcrum.ray.ingress import RayService
from fulcrum.ray.rawhttp import RawRequest, ResponseHead, run_asgi
from fulcrum.ray.wire import WireContext
from fulcrum.service import ServiceSettings
from fulcrum.stats import ModelStats

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
"""


class Answer:
    """An awaitable answer, as a `DeploymentResponse` is."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __await__(self) -> Any:
        async def value() -> object:
            return self.value

        return value().__await__()

    def cancel(self) -> None:
        pass


class Method:
    """`handle.<method>`: records each `.remote(...)` call and answers with `reply(*args)`."""

    def __init__(self, reply: Callable[..., object]) -> None:
        self.reply = reply
        self.calls: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> Answer:
        self.calls.append(args)
        return Answer(self.reply(*args))


class FakeHandle:
    def __init__(self) -> None:
        def infer(wire: WireContext, name: str, version: int | None, request: InferRequest) -> Any:
            return 1, InferResult(dict(request.inputs), 0.001, 0.002, 1)

        self.infer = Method(infer)


class FakeHub:
    def __init__(self, snapshots: list[ReplicaSnapshot]) -> None:
        self.collect = Method(lambda model, timeout_s: snapshots)


def rows(num: int) -> list[dict[str, object]]:
    stats = ModelStats()
    for _ in range(num):
        stats.record_success(1, 0.01, 0.001, 0.005)
    return [stats.to_json("echo", 1)]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "echo" / "1").mkdir(parents=True)
    (tmp_path / "echo" / "config.toml").write_text(ECHO)
    return tmp_path


async def started(repo: Path, hub: FakeHub | None = None) -> tuple[RayService, FakeHandle]:
    handle = FakeHandle()
    service = RayService(repo, {"echo": handle}, hub or FakeHub([]), ServiceSettings())
    await service.start()
    return service, handle


CTX = RequestContext("r1", "default", "v2", deadline_s=None, received_s=None)


def request_of(data: np.ndarray) -> InferRequest:
    return InferRequest("id", {"x": data}, (), False, None, None, {})


async def test_infer_goes_to_the_models_handle_with_a_portable_context(repo: Path) -> None:
    service, handle = await started(repo)
    data = np.ones((2, 4), dtype=np.float32)
    ctx = RequestContext("r1", "default", "v2", deadline_s=10**9, received_s=1.0)
    version, result = await service.infer(ctx, "echo", None, request_of(data))
    assert version == 1 and result.outputs["x"] is data
    ((wire, name, asked_version, _),) = handle.infer.calls
    assert isinstance(wire, WireContext) and name == "echo" and asked_version is None
    assert wire.ctx.deadline_s is None and wire.remaining_s is not None and wire.age_s is not None


async def test_unknown_model_is_404_before_any_call(repo: Path) -> None:
    service, handle = await started(repo)
    with pytest.raises(NotFound):
        await service.infer(CTX, "nope", None, request_of(np.ones((1, 4), np.float32)))
    assert handle.infer.calls == []


async def test_repository_load_is_refused_on_a_cluster(repo: Path) -> None:
    service, _ = await started(repo)
    with pytest.raises(InvalidInput, match="redeploying"):
        await service.load(CTX, "echo")


async def test_statistics_sum_what_the_hub_collected(repo: Path) -> None:
    snapshots = [
        ReplicaSnapshot("a", "echo", rows(3), ""),
        ReplicaSnapshot("b", "echo", rows(4), ""),
    ]
    service, _ = await started(repo, FakeHub(snapshots))
    figures = await service.statistics_of_replicas(CTX, "echo", None)
    (row,) = figures["model_stats"]
    assert row["inference_count"] == 7 and len(row["replicas"]) == 2
    assert (await service.statistics_of_replicas(CTX, None, 2))["model_stats"] == []


def streaming_app(gone: asyncio.Event) -> Starlette:
    async def chunks(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b"one"
            yield b"two"
            try:
                await asyncio.Event().wait()  # until the consumer goes
            finally:
                gone.set()

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/s", chunks, methods=["POST"])])


async def test_run_asgi_streams_the_head_then_chunks_and_stops_the_app_when_cut() -> None:
    gone = asyncio.Event()
    request = RawRequest("POST", "/s", b"", [(b"content-type", b"application/json")], b"{}")
    stream = run_asgi(streaming_app(gone), request)
    head = await stream.__anext__()
    assert isinstance(head, ResponseHead) and head.status == 200
    assert [await stream.__anext__(), await stream.__anext__()] == [b"one", b"two"]
    await stream.aclose()  # the client went away
    await asyncio.wait_for(gone.wait(), 5)
